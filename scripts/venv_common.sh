# Sourced by the scripts/setup_*_venv.sh scripts, whose test stages each run in a virtualenv
# of their own next to the main .venv.

# The CPU build of torch every virtualenv uses. It goes in first, from its own requirement, so
# that resolving what comes after never reaches for a CUDA build.
TORCH_SPEC="torch==2.13.0"

# venv_is_current STAMP FILE...: whether STAMP exists and is newer than every FILE (the
# scripts and requirement files the virtualenv was built from).
venv_is_current() {
    local stamp=$1 file
    shift
    [[ -f "$stamp" ]] || return 1
    for file in "$@"; do
        [[ "$stamp" -nt "$file" ]] || return 1
    done
}

# create_cpu_torch_venv PYTHON VENV: the virtualenv, with a current pip and the CPU torch.
create_cpu_torch_venv() {
    "$1" -m venv "$2"
    "$2/bin/python" -m pip install --quiet --upgrade pip
    "$2/bin/python" -m pip install --quiet "$TORCH_SPEC"
}
