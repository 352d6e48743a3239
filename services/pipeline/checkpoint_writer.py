"""Checkpoints written beside the event loop, so generation and scoring go on meanwhile.

The driver's state is captured when the checkpoint is started (at a step boundary, the learner
idle); the learner's ranks then write their part, and only that holds the learner. The same
thread then hashes the files once, writes the manifest, flushes and renames the directory into
place while the learner takes its next steps: for a large model that is tens of GB to hash and
fsync, minutes the learner no longer waits. The loop only polls `holds_learner` and `done`.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Collection
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

from services.pipeline.checkpoints import (
    LEARNER_DIR,
    begin_checkpoint,
    finish_checkpoint,
    prune_checkpoints,
)

log = logging.getLogger(__name__)


class CheckpointWriter:
    """At most one checkpoint in flight; `result` re-raises what writing it raised.

    `hold_learner_until_written` keeps the learner held until the checkpoint is complete
    (hashed, flushed, renamed): the behaviour before the learner was released early, kept as
    the benchmark's baseline.
    """

    def __init__(self, hold_learner_until_written: bool = False) -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kpo-checkpoint")
        self._future: Future[int] | None = None
        self._learner_written = threading.Event()
        self._hold_until_written = hold_learner_until_written

    @property
    def busy(self) -> bool:
        return self._future is not None

    @property
    def done(self) -> bool:
        return self._future is not None and self._future.done()

    @property
    def holds_learner(self) -> bool:
        """The checkpoint in flight still needs the learner (its ranks are writing their part)."""
        if self._future is None or self._future.done():
            return False
        return self._hold_until_written or not self._learner_written.is_set()

    def start(
        self,
        root: Path,
        step: int,
        driver_state: dict[str, Any],
        write_learner: Callable[[Path], Callable[[], object]],
        keep: int,
        protect: Collection[int] = (),
    ) -> None:
        """Write checkpoint `step` under `root` in the background (`driver_state` is final).

        `write_learner(dir)` starts the learner's part, here on the caller's thread, and returns
        what waits for it (run by the writer thread). The learner's calls must be made by the
        thread that makes its other calls: its ranks run collectives, each rank runs its calls
        in the order they were submitted, and two submitting threads could order two ranks'
        calls differently (a checkpoint and a publish), each rank then waiting on the other."""
        if self._future is not None:
            raise RuntimeError("a checkpoint is being written already")
        self._learner_written.clear()
        tmp = begin_checkpoint(root, step)
        wait_for_learner = write_learner(tmp / LEARNER_DIR)

        def write() -> int:
            wait_for_learner()
            self._learner_written.set()
            finish_checkpoint(root, step, tmp, driver_state)
            prune_checkpoints(root, keep, protect)
            return step

        self._future = self._pool.submit(write)

    def result(self) -> int:
        """Wait for the checkpoint in flight; its step (raises what writing it raised)."""
        if self._future is None:
            raise RuntimeError("no checkpoint is being written")
        future, self._future = self._future, None
        return future.result()

    def abandon(self) -> None:
        """Wait for the checkpoint in flight and forget it, failed or not (its learner died)."""
        if self._future is None:
            return
        try:
            self.result()
        except Exception as error:  # its learner is gone: this checkpoint never completes
            log.warning("checkpoint abandoned: %s: %s", type(error).__name__, error)

    def close(self) -> None:
        self.abandon()
        self._pool.shutdown(wait=True)
