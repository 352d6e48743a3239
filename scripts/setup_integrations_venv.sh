#!/usr/bin/env bash
# Creates .venv-integrations: a virtualenv, separate from the main .venv, with verl and TRL
# from PyPI, the CPU build of torch and this repo (editable). The tests of
# kpo_core/integrations run in it:
#
#   bash scripts/setup_integrations_venv.sh
#   .venv-integrations/bin/python -m pytest tests/integrations
#
# Idempotent: does nothing while the virtualenv is newer than this script, venv_common.sh and
# the requirements files it installs (see begin_venv in venv_common.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/venv_common.sh

FRAMEWORKS="requirements/integrations.txt"
DEPS="requirements/integrations-deps.txt"
begin_venv .venv-integrations "$FRAMEWORKS" "$DEPS"
# torch is held at the CPU build by a constraint: no later resolution may swap in a CUDA one.
CONSTRAINT="$VENV/torch-constraint.txt"
echo "$TORCH_SPEC" > "$CONSTRAINT"
"${PIP[@]}" -c "$CONSTRAINT" -r "$DEPS"
"${PIP[@]}" --no-deps -r "$FRAMEWORKS"
# The repo itself: kpo_core needs only torch, numpy and pydantic, all present by now. The
# install also registers kpo_core's verl plugin entry point.
"${PIP[@]}" --no-deps -e .

# Fail here, not in the tests, when the install is unusable.
"$PY" - <<'PYEOF'
import torch
import trl
import verl
from trl import GRPOTrainer  # noqa: F401
from verl.trainer.ppo.core_algos import POLICY_LOSS_REGISTRY

assert "+cpu" in torch.__version__, f"expected the CPU build of torch, got {torch.__version__}"
assert "kpo" in POLICY_LOSS_REGISTRY, "kpo_core's verl plugin did not register its losses"
print(f"verl {verl.__version__}, trl {trl.__version__}, torch {torch.__version__}")
PYEOF

finish_venv
