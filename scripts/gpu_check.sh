#!/usr/bin/env bash
# The checks that need a GPU, on a machine with one (never in CI: `make test` ignores tests/gpu):
#
#   1. the pipeline on one GPU (scripts/gpu_check.py): a random-initialised ~0.5B Qwen2 model,
#      3 learner steps on CUDA, vLLM streaming generation with in-flight weight updates; prints
#      the time of each stage. Nothing is downloaded.
#   2. tests/gpu: the learner on CUDA (NCCL, bfloat16 over float32 master weights, chunked
#      log-probs' memory) and the weight group's CUDA IPC handover on one GPU.
#
#   bash scripts/gpu_check.sh [pipeline|tests]...      # both by default; or `make gpu-check`
#
# Uses $PYTHON (default: .venv/bin/python), which needs a CUDA build of torch and, for the
# pipeline, vLLM (the gpu-worker image has both: deploy/docker/Dockerfile). The pipeline part
# must end within $GPU_CHECK_DEADLINE_S seconds (default 480); its files go to $GPU_CHECK_DIR
# (default: a new temporary directory). Fails, rather than skipping, when no CUDA device is
# visible.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-.venv/bin/python}
parts=("$@")
[ ${#parts[@]} -gt 0 ] || parts=(pipeline tests)
for part in "${parts[@]}"; do
    case "$part" in
        pipeline | tests) ;;
        *)
            echo "gpu_check: unknown part '$part' (pipeline, tests)" >&2
            exit 2
            ;;
    esac
done

"$PYTHON" - <<'PY'
import sys
import torch
if not torch.cuda.is_available():
    sys.exit(f"gpu_check: no CUDA device visible to torch {torch.__version__}")
print(f"gpu_check: torch {torch.__version__} (CUDA {torch.version.cuda}), "
      f"{torch.cuda.get_device_name(0)}")
PY
start=$(date +%s)
for part in "${parts[@]}"; do
    case "$part" in
        pipeline)
            out_args=()
            [ -z "${GPU_CHECK_DIR:-}" ] || out_args=(--out "$GPU_CHECK_DIR")
            "$PYTHON" scripts/gpu_check.py --deadline-s "${GPU_CHECK_DEADLINE_S:-480}" \
                "${out_args[@]}"
            ;;
        tests)
            "$PYTHON" -m pytest -p no:cacheprovider -q -s -rA tests/gpu
            ;;
    esac
done
echo "gpu_check: finished in $(( $(date +%s) - start )) s"
