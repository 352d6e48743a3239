#!/usr/bin/env bash
# The checks that need a GPU, on a machine with one: the learner on CUDA (NCCL, bfloat16 over
# float32 master weights, chunked log-probs' memory). Uses $PYTHON (default: .venv's), which must
# have a CUDA build of torch. Fails, rather than skipping, when no CUDA device is visible.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-.venv/bin/python}
"$PYTHON" - <<'PY'
import sys
import torch
if not torch.cuda.is_available():
    sys.exit(f"gpu_check: no CUDA device visible to torch {torch.__version__}")
print(f"gpu_check: torch {torch.__version__}, {torch.cuda.get_device_name(0)}")
PY
start=$(date +%s)
"$PYTHON" -m pytest -p no:cacheprovider -q -s -rA tests/gpu
echo "gpu_check: finished in $(( $(date +%s) - start )) s"
