"""Checkpoint bytes are hashed once, by the writer thread, after the learner is released."""

from __future__ import annotations

import hashlib
import json
import threading
from collections.abc import Callable
from pathlib import Path

import pytest

from services.pipeline.checkpoint_writer import CheckpointWriter
from services.pipeline.checkpoints import (
    HASHED,
    LEARNER_DIR,
    MANIFEST,
    checkpoint_name,
    latest_checkpoint,
    read_driver_state,
)
from services.pipeline.driver import RunDriver
from services.pipeline.launch import execute_run
from services.pipeline.outputs import RunDirectory, read_metrics
from tests.services.pipeline.conftest import tiny_spec

LARGE_BYTES = 64 << 20  # enough to take the writer thread a while to hash and flush


def learner_part(size: int) -> Callable[[Path], Callable[[], None]]:
    """A learner's part as the writer starts it: the returned wait writes it (on the writer's
    thread, as ranks write theirs in their own processes)."""

    def start(path: Path) -> Callable[[], None]:
        def write() -> None:
            path.mkdir()
            (path / "model.safetensors").write_bytes(bytes(range(256)) * (size // 256))
            (path / "learner.json").write_text('{"version": 3}', encoding="utf-8")

        return write

    return start


def checkpoint_files(path: Path) -> dict[str, Path]:
    return {
        str(file.relative_to(path)): file
        for file in path.rglob("*")
        if file.is_file() and file.name != MANIFEST
    }


def test_manifest_digests_match_the_files_which_are_hashed_once(tmp_path: Path) -> None:
    writer = CheckpointWriter()
    before = HASHED.bytes
    writer.start(tmp_path, 3, {"step": 3, "note": "ü"}, learner_part(1 << 20), keep=2)
    assert writer.result() == 3
    path = tmp_path / checkpoint_name(3)
    manifest = json.loads((path / MANIFEST).read_text(encoding="utf-8"))["files"]
    files = checkpoint_files(path)
    names = {"driver_state.json", f"{LEARNER_DIR}/model.safetensors", f"{LEARNER_DIR}/learner.json"}
    assert manifest.keys() == files.keys() == names
    for name, file in files.items():
        data = file.read_bytes()
        assert manifest[name] == {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    assert HASHED.bytes - before == sum(file.stat().st_size for file in files.values())
    assert read_driver_state(path) == {"step": 3, "note": "ü"}


def test_the_learner_is_released_while_the_checkpoint_is_hashed_and_flushed(
    tmp_path: Path,
) -> None:
    writer = CheckpointWriter()
    learner_done = threading.Event()
    start = learner_part(LARGE_BYTES)

    def write_learner(path: Path) -> Callable[[], None]:
        write = start(path)

        def wait() -> None:
            write()
            learner_done.set()

        return wait

    writer.start(tmp_path, 1, {"step": 1}, write_learner, keep=2)
    assert learner_done.wait(60)
    # The driver's loop goes on (and may start the learner's next step) while the writer thread
    # hashes 64 MB and flushes it: count the loop's turns in that window.
    turns_free = 0
    while not writer.done:
        if not writer.holds_learner:
            turns_free += 1
    assert turns_free > 0
    assert writer.result() == 1 and latest_checkpoint(tmp_path) is not None


def test_the_baseline_holds_the_learner_until_the_checkpoint_is_complete(tmp_path: Path) -> None:
    writer = CheckpointWriter(hold_learner_until_written=True)
    writer.start(tmp_path, 1, {"step": 1}, learner_part(LARGE_BYTES), keep=2)
    # Read in this order: a release seen before the end was seen is a release before the end
    # (the other order would race with the checkpoint ending between the two reads).
    while True:
        holds = writer.holds_learner
        if writer.done:
            break
        assert holds
    assert not writer.holds_learner and writer.result() == 1


@pytest.mark.usefixtures("ray_instance")
@pytest.mark.timeout(300)
def test_a_run_hashes_each_checkpoint_once_and_resume_still_catches_a_damaged_one(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    spec = tiny_spec(
        "pipeline.steps=3", "pipeline.checkpoint_every=1", "pipeline.keep_checkpoints=5"
    )
    before = HASHED.bytes
    assert execute_run(spec, RunDirectory(tmp_path)) == "succeeded"
    hashed = HASHED.bytes - before
    root = tmp_path / "checkpoints"
    written = sorted(root.glob("step-*"))
    assert [p.name for p in written] == [checkpoint_name(step) for step in (1, 2, 3)]
    # Each checkpoint's bytes once: the export at the end relied on the recorded digests.
    sizes = sum(f.stat().st_size for p in written for f in checkpoint_files(p).values())
    assert hashed == sizes
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2, 3]
    assert (tmp_path / "model").is_dir()

    weights = max(
        checkpoint_files(written[-1] / LEARNER_DIR).values(), key=lambda f: f.stat().st_size
    )
    damaged = bytearray(weights.read_bytes())
    damaged[len(damaged) // 2] ^= 0xFF
    weights.write_bytes(bytes(damaged))
    assert RunDriver(spec, RunDirectory(tmp_path), []).restore() == 2
    assert "SHA-256" in caplog.text and weights.name in caplog.text


def test_the_learners_part_is_started_on_the_callers_thread(tmp_path: Path) -> None:
    """The learner's ranks run collectives and each runs its calls in submission order: a
    checkpoint's calls made from the writer's thread could reach two ranks on either side of a
    publish made meanwhile by the driver's thread, and each rank would wait on the other."""
    started_on: list[threading.Thread] = []
    waited_on: list[threading.Thread] = []
    start = learner_part(1 << 10)

    def write_learner(path: Path) -> Callable[[], None]:
        started_on.append(threading.current_thread())
        write = start(path)

        def wait() -> None:
            waited_on.append(threading.current_thread())
            write()

        return wait

    writer = CheckpointWriter()
    writer.start(tmp_path, 1, {"step": 1}, write_learner, keep=2)
    assert started_on == [threading.current_thread()]  # before `start` returned
    assert writer.result() == 1
    assert waited_on and waited_on[0] is not threading.current_thread()
