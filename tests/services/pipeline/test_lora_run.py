"""A whole run with `learner.lora` on a real local Ray instance: generation is served merged
weights, and the run ends with the merged model and the adapter exported."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM

from services.pipeline.launch import execute_run
from services.pipeline.outputs import RunDirectory, read_metrics
from services.tasks.models import resolve_model
from tests.services.pipeline.conftest import tiny_spec

pytestmark = [pytest.mark.usefixtures("ray_instance"), pytest.mark.timeout(300)]


def test_a_lora_run_trains_and_exports_the_merged_model_and_the_adapter(tmp_path: Path) -> None:
    spec = tiny_spec("pipeline.steps=3", "learner.lora.rank=4", "learner.lora.alpha=8")
    assert execute_run(spec, RunDirectory(tmp_path)) == "succeeded"
    records = read_metrics(tmp_path)
    assert [r["step"] for r in records] == [1, 2, 3]
    assert all(r["tokens_trained"] > 0 and math.isfinite(r["policy_loss"]) for r in records)

    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "model", dtype=torch.float32)
    base = AutoModelForCausalLM.from_pretrained(resolve_model("tiny-arith"), dtype=torch.float32)
    base_weights = {name: tensor.clone() for name, tensor in base.state_dict().items()}
    adapted = PeftModel.from_pretrained(base, tmp_path / "adapter")
    assert merged.state_dict().keys() == base_weights.keys()
    # Three steps moved the adapters, so the merged projections differ from the base ones.
    assert not torch.equal(
        merged.state_dict()["model.layers.0.self_attn.q_proj.weight"],
        base_weights["model.layers.0.self_attn.q_proj.weight"],
    )
    tokens = torch.tensor([[1, 5, 6, 7, 8, 9]])
    with torch.no_grad():
        torch.testing.assert_close(
            merged(tokens).logits, adapted(tokens).logits, rtol=1e-5, atol=1e-5
        )
