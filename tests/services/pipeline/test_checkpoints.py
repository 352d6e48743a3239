"""Checkpoint directories: atomic, verified against their manifest, pruned, found by step."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from services.messages import ScoredGroup
from services.pipeline.checkpoints import (
    checkpoint_at,
    discard_checkpoints_after,
    latest_checkpoint,
    list_checkpoints,
    prune_checkpoints,
    read_driver_state,
    write_checkpoint,
)
from services.pipeline.records import group_from_json, group_to_json
from tests.services.pipeline.builders import scored_group


def fake_learner(path: Path) -> None:
    path.mkdir()
    (path / "model.safetensors").write_bytes(b"w" * 100)


def test_written_checkpoints_are_found_newest_first_and_pruned(tmp_path: Path) -> None:
    for step in (2, 4, 6):
        write_checkpoint(tmp_path, step, {"step": step}, fake_learner)
    found = latest_checkpoint(tmp_path)
    assert found is not None and found[0] == 6
    assert read_driver_state(found[1]) == {"step": 6}
    prune_checkpoints(tmp_path, keep=2)
    assert [step for step, _ in list_checkpoints(tmp_path)] == [4, 6]


def test_pruning_keeps_the_protected_checkpoints(tmp_path: Path) -> None:
    for step in (2, 4, 6, 8):
        write_checkpoint(tmp_path, step, {"step": step}, fake_learner)
    prune_checkpoints(tmp_path, keep=1, protect=(2, 5))  # 5: none there, nothing happens
    assert [step for step, _ in list_checkpoints(tmp_path)] == [2, 8]


def test_a_rollback_discards_the_checkpoints_after_its_own(tmp_path: Path) -> None:
    for step in (2, 4, 6):
        write_checkpoint(tmp_path, step, {"step": step}, fake_learner)
    assert discard_checkpoints_after(tmp_path, 2) == [4, 6]
    assert [step for step, _ in list_checkpoints(tmp_path)] == [2]
    assert read_driver_state(checkpoint_at(tmp_path, 2)) == {"step": 2}
    with pytest.raises(FileNotFoundError, match=r"step-0*4 cannot be resumed from: it is not"):
        checkpoint_at(tmp_path, 4)
    assert discard_checkpoints_after(tmp_path, 0) == [2]
    assert list_checkpoints(tmp_path) == []


def test_a_damaged_checkpoint_is_not_resumed_at_its_step(tmp_path: Path) -> None:
    write_checkpoint(tmp_path, 2, {"step": 2}, fake_learner)
    path = checkpoint_at(tmp_path, 2)
    (path / "learner" / "model.safetensors").write_bytes(b"w" * 99)
    with pytest.raises(FileNotFoundError, match=r"cannot be resumed from: .*size"):
        checkpoint_at(tmp_path, 2)


def test_a_damaged_checkpoint_is_skipped_for_the_previous_one(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    write_checkpoint(tmp_path, 1, {"step": 1}, fake_learner)
    newest = write_checkpoint(tmp_path, 2, {"step": 2}, fake_learner)
    (newest / "learner" / "model.safetensors").write_bytes(b"w" * 10)  # truncated
    found = latest_checkpoint(tmp_path)
    assert found is not None and found[0] == 1
    assert "wrong size ['learner/model.safetensors']" in caplog.text


def test_changed_bytes_of_the_same_size_are_caught_by_the_digest(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    write_checkpoint(tmp_path, 1, {"step": 1}, fake_learner)
    newest = write_checkpoint(tmp_path, 2, {"step": 2}, fake_learner)
    weights = newest / "learner" / "model.safetensors"
    damaged = bytearray(weights.read_bytes())
    damaged[50] ^= 0xFF  # one flipped byte, same size: a silent disk or copy error
    weights.write_bytes(bytes(damaged))
    found = latest_checkpoint(tmp_path)
    assert found is not None and found[0] == 1
    assert "SHA-256" in caplog.text and "learner/model.safetensors" in caplog.text


def test_a_manifest_of_sizes_only_is_still_accepted(tmp_path: Path) -> None:
    # Checkpoints written before digests were recorded: {name: size}.
    path = write_checkpoint(tmp_path, 5, {"step": 5}, fake_learner)
    manifest = json.loads((path / "manifest.json").read_text())
    manifest["files"] = {name: entry["size"] for name, entry in manifest["files"].items()}
    (path / "manifest.json").write_text(json.dumps(manifest))
    found = latest_checkpoint(tmp_path)
    assert found is not None and found[0] == 5
    (path / "driver_state.json").write_text("{}" + " " * 100)  # the size now differs
    assert latest_checkpoint(tmp_path) is None


def test_a_write_that_dies_midway_leaves_no_checkpoint(tmp_path: Path) -> None:
    def dies(path: Path) -> None:
        path.mkdir()
        raise OSError("disk full")

    with pytest.raises(OSError):
        write_checkpoint(tmp_path, 3, {}, dies)
    assert latest_checkpoint(tmp_path) is None
    prune_checkpoints(tmp_path, keep=1)
    assert list(tmp_path.iterdir()) == []  # the temporary directory is cleaned up


def test_groups_round_trip_through_json() -> None:
    group = scored_group("p", 7, (1.0, 0.0, 0.5))
    again = group_from_json(json.loads(json.dumps(group_to_json(group))))
    assert isinstance(again, ScoredGroup) and again == group
