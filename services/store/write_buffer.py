"""Writes in call order that survive a short outage of the server behind a store.

A write is a callable that makes one idempotent write: running it twice stores it once (the Redis
store makes each so with an op token, or for metrics with the record's step). `write_or_buffer`
runs it, retrying transient errors with backoff (`RetryPolicy`); past the deadline it appends the
write to an in-memory queue and returns None. `write_now` does the same but raises
`StoreUnavailable` instead of queueing. While the queue is not empty every later write queues
behind it, so writes are stored in the order they were made, never reordered. The queue drains on
the next write after the server is back, from a background thread every `flush_interval_s`, or
in `flush()` / `close()`.

Bounds and losses, said plainly:
- The queue holds at most `capacity` writes (calls, not records). When it is full, a write that
  would be queued raises `BufferFull` instead: it was not accepted and is the caller's to retry;
  nothing accepted is ever dropped to make room.
- Queued writes live in this process's memory: if the process dies before the server is back,
  they are lost. `close()` raises `StoreUnavailable` if any could not be stored by then.
- A queued write that the store rejects when it is finally made (a `StoreError`: the run is
  unknown, the transition became illegal) is logged and removed: that is its outcome, and there
  is no caller left to tell. Any other error keeps it at the head of the queue, logged, to be
  tried again, so an unexpected failure blocks the queue (and then fills it) loudly.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import TypeVar, cast

from services.store.errors import BufferFull, StoreError, StoreUnavailable
from services.store.retry import RetryPolicy, call_with_retry

T = TypeVar("T")

log = logging.getLogger(__name__)


class WriteBuffer:
    """The ordered write path of one store instance, with its outage queue."""

    def __init__(
        self,
        policy: RetryPolicy,
        transient: tuple[type[Exception], ...],
        capacity: int = 10_000,
        flush_interval_s: float = 0.5,
    ) -> None:
        if capacity < 1:
            raise ValueError(f"buffer capacity must be >= 1, got {capacity}")
        self._policy = policy
        self._transient = transient
        # Errors after which a queued write stays queued and is tried again later.
        self._retry_later: tuple[type[Exception], ...] = (*transient, StoreUnavailable)
        self._capacity = capacity
        self._flush_interval_s = flush_interval_s
        self._queue: deque[Callable[[], object]] = deque()
        # Held while the queue is drained or appended to: it is what keeps queued writes in order.
        # Re-entrant because a write that fails while the queue drains is queued under it.
        self._lock = threading.RLock()
        self._stopped = threading.Event()
        self._flusher: threading.Thread | None = None

    @property
    def pending(self) -> int:
        """Writes accepted but not yet stored."""
        return len(self._queue)

    def write_now(self, write: Callable[[], T]) -> T:
        """Make `write` behind any queued writes and return its result, or raise
        `StoreUnavailable` if the server stays unreachable past the retry deadline."""
        # None comes back only from a write that was queued, which may_buffer=False rules out.
        return cast(T, self._submit(write, may_buffer=False))

    def write_or_buffer(self, write: Callable[[], T]) -> T | None:
        """Make `write` behind any queued writes and return its result, or queue it and return
        None if the server stays unreachable past the retry deadline (`BufferFull` if the queue
        is full)."""
        return self._submit(write, may_buffer=True)

    def _submit(self, write: Callable[[], T], *, may_buffer: bool) -> T | None:
        if self._stopped.is_set():
            raise StoreUnavailable("the store is closed")
        if self._queue:
            with self._lock:
                # Writes already wait: this one goes behind them. A caller that cannot be
                # buffered waits up to the deadline for the queue to drain; others try each
                # queued write once and move on (the flusher keeps trying), so that an outage
                # does not stall every call.
                patience = 0.0 if may_buffer else self._policy.deadline_s
                if not self._drain(deadline=time.monotonic() + patience):
                    self._queue_or_raise(write, may_buffer, None)
                    return None
        # Nothing waits: write now. Callers skip the lock here, as no order is defined between
        # calls that overlap in time.
        try:
            return call_with_retry(write, self._policy, self._transient)
        except self._transient as error:
            self._queue_or_raise(write, may_buffer, error)
            return None

    def flush(self, timeout_s: float) -> bool:
        """Store every queued write, retrying for up to `timeout_s`; return whether none is left."""
        with self._lock:
            return self._drain(deadline=time.monotonic() + timeout_s)

    def close(self, timeout_s: float) -> None:
        """Stop the background flusher after storing what is queued; raise if any is left."""
        self._stopped.set()
        if self._flusher is not None:
            self._flusher.join()
        if not self.flush(timeout_s):
            raise StoreUnavailable(
                f"{self.pending} buffered writes could not be stored before close: "
                "the server is still unreachable"
            )

    def _queue_or_raise(
        self, write: Callable[[], object], may_buffer: bool, error: Exception | None
    ) -> None:
        reason = f"{error}" if error is not None else f"{self.pending} earlier writes wait"
        if not may_buffer:
            raise StoreUnavailable(f"the store's server is unreachable ({reason})") from error
        with self._lock:
            if len(self._queue) >= self._capacity:
                raise BufferFull(
                    f"the store's server is unreachable ({reason}) and {self._capacity} writes "
                    "are already buffered; this write was not accepted"
                ) from error
            self._queue.append(write)
            self._start_flusher()
        return None

    def _drain(self, deadline: float) -> bool:
        """Make queued writes in order until the queue is empty (True) or the server fails.

        Each write is retried until `deadline`; a deadline already past means one attempt each.
        Must be called with the lock held.
        """
        while self._queue:
            write = self._queue[0]
            try:
                call_with_retry(write, self._policy, self._transient, deadline=deadline)
            except self._retry_later:
                return False
            except StoreError as rejection:
                log.warning("a buffered store write was rejected when applied: %s", rejection)
            except Exception:
                log.exception("a buffered store write failed; it stays queued")
                return False
            # Removed only once made, so that a write racing in sees a non-empty queue until then.
            self._queue.popleft()
        return True

    def _start_flusher(self) -> None:
        """Start the background flusher on the first queued write (called with the lock held)."""
        if self._flusher is None:
            self._flusher = threading.Thread(
                target=self._flush_periodically, name="kpo-store-flusher", daemon=True
            )
            self._flusher.start()

    def _flush_periodically(self) -> None:
        while not self._stopped.wait(self._flush_interval_s):
            if self._queue:
                with self._lock:
                    self._drain(deadline=0.0)
