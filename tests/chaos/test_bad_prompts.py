"""Prompts a generation worker cannot generate, in the middle of `kpo run` (real Ray, the tiny
model): the fault policy of docs/reliability.md says the worker absorbs them.

A prompt longer than the model's context and a chat prompt for a tokenizer without a chat
template (which the backend refuses) are each dropped with their reason and counted; no actor is
replaced, the run trains every step, and every prompt is accounted for exactly once.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from services.pipeline.outputs import read_metrics
from services.tasks.models import has_chat_template, resolve_model
from tests.chaos.runs import KpoRun, assert_ledger_balances, status_of, steps_in
from tests.services.pipeline.conftest import TINY_RUN

pytestmark = pytest.mark.timeout(600)

GROUP_SIZE = 4  # TINY_RUN's
BATCH_GROUPS = 2
GOOD = [("12+30=", "42"), ("7+6=", "13"), ("50-8=", "42"), ("40+2=", "42"), ("9+9=", "18")]


def model_without_chat_template(tmp_path: Path) -> Path:
    """The tiny model, its tokenizer's chat template removed: a chat prompt is then refused."""
    directory = Path(shutil.copytree(resolve_model("tiny-arith"), tmp_path / "model"))
    (directory / "chat_template.jinja").unlink(missing_ok=True)
    config_path = directory / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config.pop("chat_template", None)
    config_path.write_text(json.dumps(config))
    assert not has_chat_template(directory)
    return directory


def prompt_file(tmp_path: Path) -> Path:
    """Good prompts, then one of 600 characters (past the tiny model's 512 positions) and one
    chat, early in the file so that the run draws both (in file order: no shuffle)."""
    rows = [{"prompt": GOOD[0][0], "answer": GOOD[0][1]}]
    rows.append({"prompt": "1+" * 300, "answer": "1"})
    rows.append({"prompt": [{"role": "user", "content": "1+1="}], "answer": "2"})
    rows += [{"prompt": question, "answer": answer} for question, answer in GOOD[1:]]
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def test_a_too_long_prompt_and_a_refused_one_are_dropped_and_counted_without_a_replacement(
    tmp_path: Path,
) -> None:
    task = {"name": "dataset", "path": str(prompt_file(tmp_path)), "shuffle": False}
    base = {**TINY_RUN, "task": task, "model": str(model_without_chat_template(tmp_path))}
    overrides = (
        "reward.verifier=math",
        "pipeline.steps=3",
        f"pipeline.batch_groups={BATCH_GROUPS}",
        "generation.prompts_per_batch=2",
        "generation.max_new_tokens=16",
    )
    with KpoRun(tmp_path, *overrides, base=base) as run:
        assert run.finish() == 0, run.output
    assert steps_in(run.out) == [1, 2, 3]
    assert status_of(run.out)["state"] == "succeeded"
    last = read_metrics(run.out)[-1]
    assert last["generation_replacements"] == 0
    # Each drawn once per pass through the file: both kinds were dropped, the chat not as long.
    assert last["prompts_too_long"] >= 1
    assert last["groups_dropped_invalid"] > last["prompts_too_long"]
    assert last["rollouts_dropped_invalid"] == GROUP_SIZE * last["groups_dropped_invalid"]
    assert "dropped (prompt_too_long)" in run.output
    assert "dropped (refused)" in run.output and "no chat template" in run.output
    assert "Traceback" not in run.output
    state = assert_ledger_balances(run.out, BATCH_GROUPS)
    # Dropped prompts are accounted for by the checkpoint's count (refusals may have come in
    # after the last record).
    assert state["counters"]["groups_dropped_invalid"] >= last["groups_dropped_invalid"]
