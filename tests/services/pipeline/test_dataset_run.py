"""Runs on dataset files of each format with the `math` verifier (real Ray, the tiny model).

The verl file's chats go through the ChatML template the tiny model ships; the other formats'
string prompts through the same template (`chat_template: auto`, `always`) or raw (`never`).
Accuracy does not matter here (the tiny model knows arithmetic written its own way): every step
must train on the file's prompts and be recorded.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from services.pipeline.launch import execute_run
from services.pipeline.outputs import RunDirectory, read_metrics
from services.pipeline.specs import apply_overrides
from services.spec import RunSpec
from tests.services.pipeline.conftest import TINY_RUN

pytestmark = [pytest.mark.usefixtures("ray_instance"), pytest.mark.timeout(300)]

QUESTIONS = [("12+30", "42"), ("7*6", "42"), ("50-8", "42"), ("40+2", "42")]


def rows_of(dataset_format: str) -> list[dict[str, Any]]:
    if dataset_format == "verl":
        return [
            {
                "data_source": "arith",
                "prompt": [{"role": "user", "content": f"{q}="}],
                "reward_model": {"style": "rule", "ground_truth": a},
                "extra_info": {"index": i},
            }
            for i, (q, a) in enumerate(QUESTIONS)
        ]
    if dataset_format == "gsm8k":
        return [{"question": f"{q}=", "answer": f"{q}={a}\n#### {a}"} for q, a in QUESTIONS]
    if dataset_format == "math":
        return [{"problem": f"{q}=", "solution": f"$\\boxed{{{a}}}$"} for q, a in QUESTIONS]
    return [{"prompt": f"{q}=", "answer": a} for q, a in QUESTIONS]


@pytest.mark.parametrize(
    ("dataset_format", "suffix", "chat_template"),
    [
        ("verl", ".parquet", "auto"),
        ("gsm8k", ".jsonl", "auto"),
        ("math", ".json", "never"),
        ("prompt-answer", ".parquet", "always"),
    ],
)
def test_each_format_trains_two_steps_with_the_math_verifier(
    tmp_path: Path, dataset_format: str, suffix: str, chat_template: str
) -> None:
    path = tmp_path / f"train{suffix}"
    rows = rows_of(dataset_format)
    if suffix == ".parquet":
        pq.write_table(pa.Table.from_pylist(rows), path)
    elif suffix == ".json":
        path.write_text(json.dumps(rows))
    else:
        path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    task = {"name": "dataset", "path": str(path), "chat_template": chat_template}
    spec = RunSpec.model_validate(
        apply_overrides(
            {**TINY_RUN, "task": task},
            [
                "reward.verifier=math",
                "pipeline.mode=sync",
                "pipeline.steps=2",
                "pipeline.batch_groups=2",
                "pipeline.checkpoint_every=0",
                "generation.prompts_per_batch=2",
                "generation.max_new_tokens=16",
            ],
        )
    )
    assert execute_run(spec, RunDirectory(tmp_path / "run")) == "succeeded"
    records = read_metrics(tmp_path / "run")
    assert [record["step"] for record in records] == [1, 2]
    assert all(record["tokens_trained"] > 0 for record in records)
