"""A checkpointed step's metrics record survives a driver killed between the checkpoint and the
record: the record travels in the checkpoint, and a resumed driver records it once.

The record of a step at a checkpoint boundary is emitted only after its checkpoint is written
(so that it is never recorded for a step that would be redone). A driver killed in that window
leaves a checkpoint of step N with no record of step N anywhere, or (killed while the record
went from one keeper to the next) in the run directory and not in the store; the resumed run goes
on from N + 1, so without this the run's history (or the store's) would miss step N for good.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from services.observers import MetricsRecord, RunState
from services.pipeline.driver import RunDriver
from services.pipeline.outputs import RunDirectory
from services.pipeline.store_observer import StoreObserver
from services.store import LocalStore
from tests.services.pipeline.conftest import tiny_spec


class Recorder:
    """An observer that keeps what it is told (as the store's observer would store it)."""

    def __init__(self) -> None:
        self.records: list[MetricsRecord] = []

    def on_metrics(self, record: MetricsRecord) -> None:
        self.records.append(record)

    def on_status(self, state: RunState, error: str | None = None, **details: Any) -> None:
        pass


def checkpoint_with_a_held_record(run_dir: RunDirectory, step: int) -> MetricsRecord:
    """What a driver leaves when it is killed right after writing checkpoint `step`: records
    through step - 1 in metrics.jsonl, and the checkpoint of `step` holding that step's record."""
    driver = RunDriver(tiny_spec(), run_dir, [])
    for earlier in range(1, step):
        run_dir.on_metrics({"step": earlier, "reward_mean": 0.1})
    record: MetricsRecord = {"step": step, "reward_mean": 0.25}
    driver.counters.step = step
    driver._held_record = record  # the loop held it for the checkpoint, as at every boundary

    def save_checkpoint(path: str) -> Callable[[], None]:  # the learner's part: any file
        def wait() -> None:
            Path(path).mkdir(parents=True, exist_ok=True)
            Path(path, "weights.bin").write_bytes(b"w")

        return wait

    learner = SimpleNamespace(save_checkpoint=save_checkpoint)
    driver._start_checkpoint(SimpleNamespace(learner=learner))  # type: ignore[arg-type]
    assert driver._checkpoints.result() == step
    driver._checkpoints.close()
    return record


def test_a_resumed_driver_records_the_checkpointed_step_that_its_predecessor_did_not(
    tmp_path: Path,
) -> None:
    run_dir = RunDirectory(tmp_path / "run")
    record = checkpoint_with_a_held_record(run_dir, step=2)
    assert [r["step"] for r in run_dir.read_metrics()] == [1]

    recorder = Recorder()
    resumed = RunDriver(tiny_spec(), run_dir, [recorder])
    assert resumed.restore() == 2
    assert recorder.records == [record]
    assert [r["step"] for r in run_dir.read_metrics()] == [1, 2]

    # Once recorded, a later resume from the same checkpoint records nothing twice.
    again = Recorder()
    assert RunDriver(tiny_spec(), run_dir, [again]).restore() == 2
    assert again.records == []
    assert [r["step"] for r in run_dir.read_metrics()] == [1, 2]


def test_a_resumed_driver_gives_the_store_the_checkpointed_step_the_run_directory_got_alone(
    tmp_path: Path,
) -> None:
    """Killed after the run directory took step 2's record and before the store did: the resumed
    driver's rewind gives the store that record, and the run directory keeps its one copy."""
    run_dir = RunDirectory(tmp_path / "run")
    record = checkpoint_with_a_held_record(run_dir, step=2)
    run_dir.on_metrics(record)  # the first keeper got it; the store below never did
    store = LocalStore(tmp_path / "store")
    try:
        run = store.create_run({"name": "t"})
        store.append_metrics(run.id, [{"step": 1, "reward_mean": 0.1}])
        recorder = Recorder()  # keeps nothing: it heard step 2 from the killed driver already
        observers = [StoreObserver(store, run.id, total_steps=8), recorder]
        assert RunDriver(tiny_spec(), run_dir, observers).restore() == 2
        assert [r["step"] for r in store.read_metrics(run.id)] == [1, 2]
        assert store.read_metrics(run.id)[-1]["reward_mean"] == record["reward_mean"]
        assert [r["step"] for r in run_dir.read_metrics()] == [1, 2]
        assert recorder.records == []
    finally:
        store.close()
