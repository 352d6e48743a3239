"""Server-sent events of one run: its stored events, then new ones as they are written.

The store's event log is the source, so a client that reconnects with `Last-Event-ID` gets
exactly the events after that one, whichever control-plane process serves it. The stream ends
once the run has finished and every event has been sent.

Streams are long-lived, so they are bounded, lest they starve the server:

- at most `KPO_MAX_STREAMS` are open at once, and `KPO_MAX_STREAMS_PER_CLIENT` per client
  address, as services.api.client_identity tells clients apart (`StreamSlots`); past either
  the request is a 429;
- each ends after `KPO_STREAM_LIFETIME_S`, between two events; every stream starts with an SSE
  `retry:` field, and the client reconnects after it with `Last-Event-ID` and resumes exactly
  where it was (browsers' EventSource and `kpo submit --follow` do so by themselves);
- their store reads run on worker threads of their own (`EventStreams.limiter`, at most
  `STREAM_THREADS` at once), not on the pool that serves the routes: many streams polling a slow
  store wait for each other, never make a route wait.
"""

from __future__ import annotations

import json
import math
import threading
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from anyio import CapacityLimiter, sleep, to_thread
from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from services.pipeline.outputs import json_safe
from services.store import TERMINAL_STATUSES, Event, Store

POLL_SECONDS = 0.5
PING_SECONDS = 15.0
BATCH = 500
# Worker threads that all event streams together read the store on.
STREAM_THREADS = 8
# How soon a client reconnects once a stream has ended before its run did (the SSE `retry:`).
RETRY_MS = 1000


class StreamSlots:
    """Open event streams, counted in all and per client address (thread-safe)."""

    def __init__(self, total: int, per_client: int) -> None:
        self.total = total
        self.per_client = per_client
        self._open: Counter[str] = Counter()
        self._lock = threading.Lock()

    @property
    def open(self) -> int:
        with self._lock:
            return self._open.total()

    def acquire(self, client: str) -> str | None:
        """Take a slot for `client`: None when taken, else why not (the 429's message)."""
        with self._lock:
            if self._open.total() >= self.total:
                return (
                    f"{self.total} event streams are open, the most this server serves "
                    "(KPO_MAX_STREAMS); try again later"
                )
            if self._open[client] >= self.per_client:
                return (
                    f"{self.per_client} event streams of this client are open, the most one "
                    "client may hold (KPO_MAX_STREAMS_PER_CLIENT); close one"
                )
            self._open[client] += 1
            return None

    def release(self, client: str) -> None:
        with self._lock:
            self._open[client] -= 1
            if self._open[client] <= 0:
                del self._open[client]


@dataclass
class EventStreams:
    """What bounds the event streams of one app (see the module docstring)."""

    slots: StreamSlots
    lifetime_s: float
    limiter: CapacityLimiter = field(default_factory=lambda: CapacityLimiter(STREAM_THREADS))


class SlotResponse(StreamingResponse):
    """A streaming response that gives its stream slot back however it ends (finished, client
    gone, server shutting down), since the stream's generator may never even start."""

    def __init__(self, content: AsyncIterator[str], release: Callable[[], None], **kw: Any) -> None:
        super().__init__(content, **kw)
        self._release = release

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._release()


def format_event(event: Event) -> str:
    """One SSE message; the data is one line of JSON, so it needs no `data:` continuation.

    NaN and infinities (a diverged metric) become null: JSON has no such numbers, and a browser's
    JSON.parse rejects the whole message over one of them.
    """
    data = json.dumps(json_safe(event.data), allow_nan=False)
    return f"id: {event.id}\nevent: {event.kind}\ndata: {data}\n\n"


async def run_events(
    request: Request,
    store: Store,
    run_id: str,
    after_id: str | None,
    *,
    limiter: CapacityLimiter | None = None,
    lifetime_s: float = math.inf,
    clock: Callable[[], float] = time.monotonic,
) -> AsyncIterator[str]:
    """The SSE messages of `run_id` after event `after_id`, until the run ends, the client goes
    or `lifetime_s` has passed (then the client resumes after the last id it got).

    Store calls block (SQLite, Redis), so they run in worker threads, off the event loop: on
    `limiter`'s (None: the default pool).
    """

    async def call(read: Callable[..., Any], *args: Any) -> Any:
        return await to_thread.run_sync(read, *args, limiter=limiter)

    started = last_sent = clock()
    yield f"retry: {RETRY_MS}\n\n"
    while clock() - started < lifetime_s:
        events = await call(store.read_events, run_id, after_id, BATCH)
        for event in events:
            yield format_event(event)
            after_id = event.id
        if events:
            last_sent = clock()
            if len(events) == BATCH:
                continue
        run = await call(store.get_run, run_id)
        if run.status in TERMINAL_STATUSES:
            # Events written between the read above and the status check come in one more pass.
            tail = await call(store.read_events, run_id, after_id, BATCH)
            for event in tail:
                yield format_event(event)
            return
        if await request.is_disconnected():
            return
        if clock() - last_sent >= PING_SECONDS:
            yield ": ping\n\n"  # keeps proxies from closing an idle stream
            last_sent = clock()
        await sleep(POLL_SECONDS)
