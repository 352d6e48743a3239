"""Checkpoints written beside the event loop, so generation and scoring go on meanwhile.

The driver's state is captured when the checkpoint is started (at a step boundary, the learner
idle); the learner's ranks then write their part and a thread hashes, flushes and renames the
directory into place. Writing a checkpoint of a large model takes minutes (tens of GB to hash
and fsync): the loop only polls `done`, and the learner takes no step until it is written.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

from services.pipeline.checkpoints import prune_checkpoints, write_checkpoint

log = logging.getLogger(__name__)


class CheckpointWriter:
    """At most one checkpoint in flight; `result` re-raises what writing it raised."""

    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kpo-checkpoint")
        self._future: Future[int] | None = None

    @property
    def busy(self) -> bool:
        return self._future is not None

    @property
    def done(self) -> bool:
        return self._future is not None and self._future.done()

    def start(
        self,
        root: Path,
        step: int,
        driver_state: dict[str, Any],
        write_learner: Callable[[Path], None],
        keep: int,
    ) -> None:
        """Write checkpoint `step` under `root` in the background (`driver_state` is final)."""
        if self._future is not None:
            raise RuntimeError("a checkpoint is being written already")

        def write() -> int:
            write_checkpoint(root, step, driver_state, write_learner)
            prune_checkpoints(root, keep)
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
