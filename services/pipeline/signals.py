"""SIGINT (Ctrl-C) and SIGTERM (`ray job stop`, Kubernetes) as the run's stop request."""

from __future__ import annotations

import signal
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import FrameType

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


@contextmanager
def on_stop_signals(handler: Callable[[int, FrameType | None], None]) -> Iterator[None]:
    """Let `handler` take SIGINT and SIGTERM inside the block; the previous handlers after.

    Off the main thread, signals stay with whoever owns them and this does nothing.
    """
    try:
        previous = {signum: signal.signal(signum, handler) for signum in STOP_SIGNALS}
    except ValueError:
        previous = {}
    try:
        yield
    finally:
        for signum, old in previous.items():
            signal.signal(signum, old)
