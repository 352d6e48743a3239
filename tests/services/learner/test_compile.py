"""`learner.compile`: each decoder layer compiled on its own gives the eager step's result.

Inductor on CPU generates and builds C++ for the layer once (the layers share it); the step
after that must match eager within float32 tolerance: the same loss, metrics and gradients.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from services.messages import ScoredGroup
from tests.services.learner.conftest import make_core

TOLERANCE = 1e-5


@pytest.mark.parametrize(
    ("pack_rows", "checkpointing"), [(False, False), (True, True)], ids=["padded", "packed-ac"]
)
def test_a_compiled_step_equals_the_eager_step(
    tiny_model_dir: Path, groups: list[ScoredGroup], pack_rows: bool, checkpointing: bool
) -> None:
    torch._dynamo.reset()
    settings = {"pack_rows": pack_rows, "gradient_checkpointing": checkpointing}
    eager = make_core(tiny_model_dir, **settings)
    compiled = make_core(tiny_model_dir, compile=True, **settings)
    layer = compiled.model.policy.model.layers[0]
    assert layer._compiled_call_impl is not None  # compiled per layer, not the whole model
    expected, got = eager.train_step(groups), compiled.train_step(groups)
    for key in ("policy_loss", "grad_norm", "clip_fraction", "approx_kl", "entropy"):
        assert got[key] == pytest.approx(expected[key], abs=TOLERANCE, rel=TOLERANCE), key
    # The gradients the optimiser stepped with (AdamW's first step is about lr x sign(g), so
    # the weights would turn a 1e-9 difference in a near-zero gradient into a full step).
    eager_grads = {n: p.grad for n, p in eager.model.policy.named_parameters()}
    for name, weight in compiled.model.policy.named_parameters():
        assert weight.grad is not None and eager_grads[name] is not None, name
        torch.testing.assert_close(weight.grad, eager_grads[name], rtol=0, atol=TOLERANCE)
