"""What the store tests share: how they open stores, and a snapshot to compare across restarts."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from services.store import Store

# Opens a new store instance on a test's data; keyword options go to the store's constructor.
StoreOpener = Callable[..., Store]


def snapshot(store: Store, run_ids: list[str]) -> dict[str, Any]:
    """The run list, the runs, and their metrics, events and logs, as the store returns them."""
    return {
        "list": store.list_runs(limit=1000),
        "runs": [store.get_run(r) for r in run_ids],
        "metrics": [store.read_metrics(r, limit=10_000) for r in run_ids],
        "events": [store.read_events(r, limit=10_000) for r in run_ids],
        "logs": [store.tail_logs(r, 10_000) for r in run_ids],
    }
