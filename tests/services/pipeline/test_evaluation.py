"""Held-out evaluation: its prompts, its metrics, and a run that evaluates (real Ray)."""

from __future__ import annotations

import json
from pathlib import Path

import datasets
import pytest

from services.messages import Prompt, Response, ScoredGroup, ScoredResponse
from services.metrics import EVAL_KEYS
from services.pipeline.evaluation import eval_metrics
from services.pipeline.held_out import NoHeldOutPrompts, held_out_prompts
from services.pipeline.launch import execute_run
from services.pipeline.outputs import EVAL_FILE, RunDirectory, read_metrics
from services.pipeline.prompts import PromptStream
from services.pipeline.specs import SpecError, apply_overrides, preflight
from services.spec import ArithTask, DatasetTask, JsonlTask, RunSpec
from tests.services.pipeline.conftest import TINY_RUN


def group(rewards: list[float]) -> ScoredGroup:
    prompt = Prompt("p", "1+1=", "2")
    response = Response("p", [1], [2], [-0.1], "stop", 0, "2")
    return ScoredGroup(prompt, [ScoredResponse(response, r, verified=True) for r in rewards])


def test_avg_at_k_averages_each_prompts_fraction_and_pass_at_k_counts_any() -> None:
    metrics = eval_metrics([group([1, 0, 0, 0]), group([0, 0, 0, 0]), group([1, 1, 1, 1])])
    assert {*metrics, "eval_step"} == set(EVAL_KEYS)  # the keys services/metrics.py declares
    assert metrics == pytest.approx(
        {"eval_accuracy_avg_at_k": (0.25 + 0 + 1) / 3, "eval_pass_at_k": 2 / 3}
    )
    # An unverified response counts as wrong, whatever its reward.
    unverified = ScoredGroup(group([1]).prompt, [group([1]).responses[0]])
    unverified.responses[0] = ScoredResponse(unverified.responses[0].response, 0.0, False)
    assert eval_metrics([unverified])["eval_pass_at_k"] == 0.0
    with pytest.raises(ValueError, match="at least one scored group"):
        eval_metrics([])


def test_the_built_in_tasks_held_out_prompts_never_meet_its_training_prompts() -> None:
    task = ArithTask(difficulty=3)
    held_out = held_out_prompts(task, seed=0, count=50)
    assert len(held_out) == 50 and all(p.prompt_id.startswith("eval:") for p in held_out)
    assert held_out == held_out_prompts(task, seed=0, count=50)  # the same at every evaluation
    training = {p.text for p in PromptStream(task, seed=0).take(2000)}
    assert not training & {p.text for p in held_out}


def test_a_dataset_task_evaluates_on_its_eval_path_or_its_directorys_split(
    tmp_path: Path,
) -> None:
    train, test = tmp_path / "train.jsonl", tmp_path / "test.jsonl"
    train.write_text(json.dumps({"question": "1+1", "answer": "#### 2"}) + "\n")
    test.write_text(
        "".join(
            json.dumps({"question": f"{i}+1", "answer": f"#### {i + 1}"}) + "\n" for i in range(5)
        )
    )
    task = DatasetTask(path=str(train), eval_path=str(test))
    held_out = held_out_prompts(task, seed=0, count=3)
    assert [(p.prompt_id, p.answer) for p in held_out] == [
        ("eval:test:1", "1"),
        ("eval:test:2", "2"),
        ("eval:test:3", "3"),
    ]
    splits = datasets.DatasetDict(
        {
            "train": datasets.Dataset.from_list([{"prompt": "a", "answer": "1"}]),
            "validation": datasets.Dataset.from_list([{"prompt": "b", "answer": "2"}]),
        }
    )
    splits.save_to_disk(str(tmp_path / "data"))
    task = DatasetTask(path=str(tmp_path / "data"), eval_split="validation")
    assert [p.text for p in held_out_prompts(task, seed=0, count=10)] == ["b"]


def test_eval_without_held_out_prompts_fails_before_anything_starts(tmp_path: Path) -> None:
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "1+1=", "answer": "2"}) + "\n")
    with pytest.raises(NoHeldOutPrompts, match="a jsonl task has no held-out prompts"):
        held_out_prompts(JsonlTask(path=str(prompts)), seed=0, count=4)
    spec = RunSpec.model_validate(
        {"task": {"name": "jsonl", "path": str(prompts)}, "eval": {"every": 2}}
    )
    with pytest.raises(SpecError, match=r"run\.yaml: eval: a jsonl task has no held-out"):
        preflight(spec, "run.yaml")


@pytest.mark.usefixtures("ray_instance")
@pytest.mark.timeout(300)
def test_a_run_evaluates_every_two_steps_and_at_the_end(tmp_path: Path) -> None:
    spec = RunSpec.model_validate(
        apply_overrides(
            TINY_RUN,
            [
                "pipeline.mode=sync",
                "pipeline.steps=4",
                "pipeline.checkpoint_every=0",
                "eval.every=2",
                "eval.samples=4",
                "eval.max_prompts=6",
            ],
        )
    )
    assert execute_run(spec, RunDirectory(tmp_path)) == "succeeded"
    lines = [json.loads(line) for line in (tmp_path / EVAL_FILE).read_text().splitlines()]
    final = [line for line in lines if line["final"]]
    assert len(final) == 1 and final[0]["eval_step"] == 4 and final[0]["prompts"] == 6
    periodic = [line for line in lines if not line["final"]]
    assert {line["eval_step"] for line in periodic} <= {2, 4} and periodic
    for line in lines:
        assert 0.0 <= line["eval_accuracy_avg_at_k"] <= line["eval_pass_at_k"] <= 1.0
    # Each finished periodic evaluation joined the next metrics record, after its step.
    records = read_metrics(tmp_path)
    evaluated = [r for r in records if "eval_step" in r]
    assert [r["eval_step"] for r in evaluated] == [line["eval_step"] for line in periodic][
        : len(evaluated)
    ]
    assert all(r["step"] > r["eval_step"] for r in evaluated)
    status = json.loads((tmp_path / "status.json").read_text())
    assert status["final_eval"]["eval_step"] == 4
