"""The SSE message format."""

from __future__ import annotations

import json
from datetime import UTC, datetime

from services.api.sse import format_event
from services.store import Event


def reject_constant(name: str) -> None:
    raise ValueError(f"not JSON: {name}")


def test_a_diverged_metric_is_sent_as_null_so_browsers_can_parse_it() -> None:
    event = Event(
        id="7",
        kind="metrics",
        data={"step": 3, "entropy": float("nan"), "nested": [float("inf"), 1.5]},
        at=datetime.now(UTC),
    )
    text = format_event(event)
    assert text.startswith("id: 7\nevent: metrics\ndata: ") and text.endswith("\n\n")
    data = json.loads(text.split("data: ", 1)[1], parse_constant=reject_constant)
    assert data == {"step": 3, "entropy": None, "nested": [None, 1.5]}
