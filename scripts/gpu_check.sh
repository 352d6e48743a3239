#!/usr/bin/env bash
# The checks that need a GPU, on a machine with one (never in CI: `make test` ignores tests/gpu):
#
#   1. the pipeline on one GPU (scripts/gpu_check.py): a random-initialised ~0.5B Qwen2 model,
#      3 learner steps on CUDA, vLLM streaming generation with in-flight weight updates; prints
#      the time of each stage. Nothing is downloaded.
#   2. learner (scripts/gpu_learner_check.py, which says it all): tests/gpu (the learner on CUDA:
#      NCCL, bfloat16 over float32 master weights, the log-prob path's memory, packed rows ==
#      padded rows, compiled layers == eager; the weight group's CUDA IPC handover; the publish
#      read on a side stream beside the next step), then the learner's speed against a plain
#      step (benchmarks/bench_learner_speed.py: three Qwen2.5-shaped cases, sized to the GPU's
#      memory), inside one --budget (default 480 s). Runs on a bare machine with only a CUDA
#      torch and transformers: `prepare` first, where there is network, brings the rest.
#   `prepare [DIR]`: download those wheels (pydantic, pytest, xxhash, zstandard and what they
#      need, for CPython 3.10-3.14 on x86_64 and aarch64) into DIR (default .gpu-check/wheels);
#      copy it along.
#   `tests`: tests/gpu alone.
#
#   bash scripts/gpu_check.sh [pipeline|learner|tests]...   # pipeline and learner by default;
#                                                           # or `make gpu-check`
#   bash scripts/gpu_check.sh prepare [DIR]                 # where there is network
#   bash scripts/gpu_check.sh learner [--budget S] [--wheels DIR] [--out DIR] [--dry-run]
#
# Uses $PYTHON (default: .venv/bin/python, else python3), which needs a CUDA build of torch and,
# for the pipeline, vLLM and Ray (the gpu-worker image has both: deploy/docker/Dockerfile). The
# pipeline part must end within $GPU_CHECK_DEADLINE_S seconds (default 480); its files go to
# $GPU_CHECK_DIR (default: a new temporary directory). Fails, rather than skipping, when no CUDA
# device is visible (the learner's --dry-run excepted).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -z "${PYTHON:-}" ]; then
    PYTHON=python3
    [ ! -x .venv/bin/python ] || PYTHON=.venv/bin/python
fi
# prepare and learner take their own flags: everything after them is theirs.
case "${1:-}" in
    prepare) shift; exec "$PYTHON" scripts/gpu_learner_check.py prepare "$@" ;;
    learner) [ $# -eq 1 ] || { shift; exec "$PYTHON" scripts/gpu_learner_check.py run "$@"; } ;;
esac
parts=("$@")
[ ${#parts[@]} -gt 0 ] || parts=(pipeline learner)
for part in "${parts[@]}"; do
    case "$part" in
        pipeline | learner | tests) ;;
        *)
            echo "gpu_check: unknown part '$part' (pipeline, learner, tests)" >&2
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
        learner)
            "$PYTHON" scripts/gpu_learner_check.py run
            ;;
        tests)
            "$PYTHON" -m pytest -p no:cacheprovider -q -s -rA tests/gpu
            ;;
    esac
done
echo "gpu_check: finished in $(( $(date +%s) - start )) s"
