# Sourced by the scripts/setup_*_venv.sh scripts, whose test stages each run in a virtualenv
# of their own next to the main .venv. PYTHON and VENV override the interpreter and the folder.

# The CPU build of torch every virtualenv uses. It goes in first, from its own requirement, so
# that resolving what comes after never reaches for a CUDA build.
TORCH_SPEC="torch==2.13.0"

# begin_venv DEFAULT_FOLDER INPUT...: sets VENV, STAMP, PY and PIP. Exits the script when the
# virtualenv was built after every INPUT (requirement files), the calling script and this file
# last changed; otherwise creates it with a current pip and the CPU torch.
begin_venv() {
    VENV="${VENV:-$1}"
    shift
    STAMP="$VENV/.installed"
    PY="$VENV/bin/python"
    PIP=("$PY" -m pip install --quiet)
    local input current=1
    for input in "scripts/$(basename "$0")" scripts/venv_common.sh "$@"; do
        [[ -f "$STAMP" && "$STAMP" -nt "$input" ]] || current=0
    done
    if ((current)); then
        echo "$VENV is up to date ($STAMP)"
        exit 0
    fi
    VENV_STARTED=$(date +%s)
    "${PYTHON:-python3}" -m venv "$VENV"
    "${PIP[@]}" --upgrade pip
    "${PIP[@]}" "$TORCH_SPEC"
}

# finish_venv: marks the virtualenv built, with its build time and size.
finish_venv() {
    touch "$STAMP"
    echo "$VENV ready in $(($(date +%s) - VENV_STARTED)) s, $(du -sh "$VENV" | cut -f1)"
}
