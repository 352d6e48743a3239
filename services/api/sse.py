"""Server-sent events of one run: its stored events, then new ones as they are written.

The store's event log is the source, so a client that reconnects with `Last-Event-ID` gets
exactly the events after that one, whichever control-plane process serves it. The stream ends
once the run has finished and every event has been sent.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Callable

from anyio import sleep, to_thread
from starlette.requests import Request

from services.pipeline.outputs import json_safe
from services.store import TERMINAL_STATUSES, Event, Store

POLL_SECONDS = 0.5
PING_SECONDS = 15.0
BATCH = 500


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
    clock: Callable[[], float] = time.monotonic,
) -> AsyncIterator[str]:
    """The SSE messages of `run_id` after event `after_id`, until the run ends or the client goes.

    Store calls block (SQLite, Redis), so they run in worker threads, off the event loop.
    """
    last_sent = clock()
    while True:
        events = await to_thread.run_sync(store.read_events, run_id, after_id, BATCH)
        for event in events:
            yield format_event(event)
            after_id = event.id
        if events:
            last_sent = clock()
            if len(events) == BATCH:
                continue
        run = await to_thread.run_sync(store.get_run, run_id)
        if run.status in TERMINAL_STATUSES:
            # Events written between the read above and the status check come in one more pass.
            tail = await to_thread.run_sync(store.read_events, run_id, after_id, BATCH)
            for event in tail:
                yield format_event(event)
            return
        if await request.is_disconnected():
            return
        if clock() - last_sent >= PING_SECONDS:
            yield ": ping\n\n"  # keeps proxies from closing an idle stream
            last_sent = clock()
        await sleep(POLL_SECONDS)
