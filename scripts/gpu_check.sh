#!/usr/bin/env bash
# The checks that need a GPU, on a machine with one (never in CI: `make test` ignores tests/gpu):
#
#   1. the pipeline on one GPU (scripts/gpu_check.py): a random-initialised ~0.5B Qwen2 model,
#      3 learner steps on CUDA, vLLM streaming generation with in-flight weight updates; prints
#      the time of each stage. Nothing is downloaded.
#   2. learner: tests/gpu (the learner on CUDA: NCCL, bfloat16 over float32 master weights,
#      the log-prob path's memory, packed rows == padded rows, compiled layers == eager; the
#      weight group's CUDA IPC handover on one GPU; the publish read on a side stream beside
#      the next step), then the learner's speed against a plain
#      step (benchmarks/bench_learner_speed.py --quick: three Qwen2.5-shaped cases).
#      Needs only torch, transformers and the project's pure-Python dependencies: no vLLM, no
#      Ray, no Redis.
#   `tests`: tests/gpu alone.
#
#   bash scripts/gpu_check.sh [pipeline|learner|tests]...   # pipeline and learner by default;
#                                                           # or `make gpu-check`
#
# Uses $PYTHON (default: .venv/bin/python), which needs a CUDA build of torch and, for the
# pipeline, vLLM and Ray (the gpu-worker image has both: deploy/docker/Dockerfile). The pipeline
# part must end within $GPU_CHECK_DEADLINE_S seconds (default 480), the learner part within
# $GPU_CHECK_LEARNER_DEADLINE_S (default 300); the pipeline's files go to $GPU_CHECK_DIR
# (default: a new temporary directory), the benchmark's figures too when it is set. Fails,
# rather than skipping, when no CUDA device is visible.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-.venv/bin/python}
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
            # One deadline for both: what the tests leave is the benchmark's. The benchmark
            # runs even when a test failed (its figures say where), and the part fails after.
            deadline=$(( $(date +%s) + ${GPU_CHECK_LEARNER_DEADLINE_S:-300} ))
            left() { local s=$(( deadline - $(date +%s) )); echo $(( s > 0 ? s : 1 )); }
            json_args=()
            [ -z "${GPU_CHECK_DIR:-}" ] || json_args=(--json "$GPU_CHECK_DIR/bench_learner_speed.json")
            status=0
            HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 timeout "$(left)" \
                "$PYTHON" -m pytest -p no:cacheprovider -q -s -rA tests/gpu || status=$?
            HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 timeout "$(left)" \
                "$PYTHON" benchmarks/bench_learner_speed.py --device cuda --quick \
                "${json_args[@]}" || status=$?
            [ "$status" -eq 0 ] || { echo "gpu_check: learner part failed ($status)" >&2; exit "$status"; }
            ;;
        tests)
            "$PYTHON" -m pytest -p no:cacheprovider -q -s -rA tests/gpu
            ;;
    esac
done
echo "gpu_check: finished in $(( $(date +%s) - start )) s"
