"""The W&B tracker in offline mode, read back from the run's transaction log (run-<id>.wandb).

That log is LevelDB's log format (32 KiB blocks of checksummed chunks) after a 7-byte header;
each record is a `wandb.proto.wandb_internal_pb2.Record`. The installed W&B has no Python
reader of it (its Go core writes it), so `read_records` is one.
"""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path
from typing import Any

import pytest
import wandb
from wandb.proto import wandb_internal_pb2

from services.spec import RunSpec
from services.tracking import build_trackers
from tests.services.tracking.records import EXPECTED_FINITE, records

BLOCK = 32768
CHUNK_HEADER = struct.Struct("<IHB")  # checksum, length, type
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


@pytest.fixture(autouse=True)
def _offline(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")


def read_records(path: Path) -> list[Any]:
    data = path.read_bytes()
    assert data[:4] == b":W&B"
    records, pending, position = [], b"", 7
    while position + CHUNK_HEADER.size <= len(data):
        left_in_block = BLOCK - position % BLOCK
        if left_in_block < CHUNK_HEADER.size:  # a block's tail too short for a chunk: padding
            position += left_in_block
            continue
        _, length, kind = CHUNK_HEADER.unpack_from(data, position)
        start = position + CHUNK_HEADER.size
        pending += data[start : start + length]
        position = start + length
        if kind in (FULL, LAST):
            # A generated protobuf module, which mypy cannot see into.
            record = wandb_internal_pb2.Record()  # type: ignore[attr-defined]
            record.ParseFromString(pending)
            records.append(record)
            pending = b""
        else:
            assert kind in (FIRST, MIDDLE)
    return records


def read_run(wandb_dir: Path) -> tuple[Any, dict[int, dict[str, Any]], Any, dict[str, Any]]:
    """The run record, the history by step, the exit record and the last summary values of
    the one offline run."""
    # `finish()` can return before W&B's service process has written the log to disk;
    # `teardown()` waits for that service to write everything and stop.
    wandb.teardown()
    [log] = wandb_dir.glob("wandb/offline-run-*/run-*.wandb")
    records = read_records(log)
    [run] = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    [exit_record] = [r.exit for r in records if r.WhichOneof("record_type") == "exit"]
    history = {
        r.history.step.num: {
            "/".join(item.nested_key) or item.key: json.loads(item.value_json)
            for item in r.history.item
        }
        for r in records
        if r.WhichOneof("record_type") == "history"
    }
    summary = {
        "/".join(item.nested_key) or item.key: json.loads(item.value_json)
        for r in records
        if r.WhichOneof("record_type") == "summary"
        for item in r.summary.update
    }
    return run, history, exit_record, summary


def test_every_record_is_history_at_its_step(tmp_path: Path) -> None:
    run_dir = tmp_path / "run-3"
    spec = RunSpec.model_validate(
        {"tracking": {"wandb": {"project": "kpo", "mode": "offline", "tags": ["ci"]}}}
    )
    [tracker] = build_trackers(spec, run_dir)
    for record in records():
        tracker.on_metrics(record)
    tracker.on_status("succeeded", step=3)

    run, history, exit_record, summary = read_run(run_dir)
    assert sorted(history) == [1, 2, 3]
    for key, expected in EXPECTED_FINITE.items():
        logged = {step: row[key] for step, row in history.items() if key in row}
        if key == "clip_fraction":  # W&B keeps a NaN
            assert math.isnan(logged.pop(2))
        assert logged == expected, key
    assert history[3]["time"] == records()[2]["time"]
    assert all("generation_batch_seconds" not in row for row in history.values())
    assert (run.project, run.display_name, list(run.tags)) == ("kpo", "run-3", ["ci"])
    config = {item.key: json.loads(item.value_json) for item in run.config.update}
    assert config["pipeline"]["steps"] == spec.pipeline.steps
    assert config["tracking"]["wandb"]["project"] == "kpo"
    assert exit_record.exit_code == 0
    assert summary["run_state"] == "succeeded"


def test_failed_run_and_dir_from_the_spec(tmp_path: Path) -> None:
    wandb_dir = tmp_path / "wandb-files"
    settings = {"project": "kpo", "name": "custom", "mode": "offline", "dir": str(wandb_dir)}
    spec = RunSpec.model_validate({"tracking": {"wandb": settings}})
    [tracker] = build_trackers(spec, tmp_path / "run")
    tracker.on_metrics(records()[0])
    tracker.on_status("failed", "RuntimeError: boom", step=1)

    run, history, exit_record, summary = read_run(wandb_dir)
    assert run.display_name == "custom"
    assert history[1]["reward_mean"] == 0.25
    assert exit_record.exit_code == 1
    assert (summary["run_state"], summary["run_error"]) == ("failed", "RuntimeError: boom")
