"""A small client of the control plane's REST API (httpx), for the `kpo` command line.

Errors come out as two exceptions that the command line prints without a traceback:
`ApiError` (the server answered with an error: its status and the message of its JSON body)
and `ServerUnreachable` (no answer at all, naming the server's URL).
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx

DEFAULT_SERVER = "http://127.0.0.1:8000"
TERMINAL = frozenset({"succeeded", "failed", "cancelled"})


class ApiError(Exception):
    """The server answered with an error status; `message` is what its body says, and
    `retry_after_s` its `Retry-After` in seconds, when it sent one (a 429, a 503)."""

    def __init__(self, status: int, message: str, retry_after_s: float | None = None) -> None:
        super().__init__(f"{message} (HTTP {status})")
        self.status = status
        self.message = message
        self.retry_after_s = retry_after_s


class ServerUnreachable(Exception):
    """The server did not answer (refused, timed out, closed the connection)."""


@dataclass(frozen=True)
class SseEvent:
    """One server-sent event of a run's stream."""

    id: str | None
    kind: str
    data: dict[str, Any]


class ApiClient:
    """Calls of the control plane at `server`, with `token` as the bearer token when given."""

    def __init__(self, server: str, token: str | None = None, timeout_s: float = 30.0) -> None:
        self.server = server.rstrip("/")
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._http = httpx.Client(base_url=self.server, headers=headers, timeout=timeout_s)

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> ApiClient:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # --- runs --------------------------------------------------------------------------------

    def create_run(self, spec: dict[str, Any], idempotency_key: str | None = None) -> Any:
        headers = {"Idempotency-Key": idempotency_key} if idempotency_key else {}
        return self._call("POST", "/v1/runs", json=spec, headers=headers)

    def list_runs(self, status: str | None = None, limit: int = 20) -> Any:
        params: dict[str, Any] = {"limit": limit}
        if status:
            params["status"] = status
        return self._call("GET", "/v1/runs", params=params)

    def get_run(self, run_id: str) -> Any:
        return self._call("GET", f"/v1/runs/{run_id}")

    def cancel_run(self, run_id: str) -> Any:
        return self._call("POST", f"/v1/runs/{run_id}/cancel")

    def resume_run(self, run_id: str, spec_patch: dict[str, Any] | None = None) -> Any:
        return self._call(
            "POST", f"/v1/runs/{run_id}/resume", json={"spec_patch": spec_patch or {}}
        )

    def get_guard(self, run_id: str) -> Any:
        return self._call("GET", f"/v1/runs/{run_id}/guard")

    # --- live events -------------------------------------------------------------------------

    def events(self, run_id: str, last_event_id: str | None = None) -> Iterator[SseEvent]:
        """The run's events after `last_event_id`, until the server ends the stream."""
        headers = {"Last-Event-ID": last_event_id} if last_event_id else {}
        # No read timeout: the stream is quiet between learner steps (a ping every 15 s).
        timeout = httpx.Timeout(self._http.timeout.connect, read=None)
        try:
            with self._http.stream(
                "GET", f"/v1/runs/{run_id}/events", headers=headers, timeout=timeout
            ) as response:
                if response.is_error:
                    response.read()
                    raise _api_error(response)
                yield from parse_sse(response.iter_lines())
        except httpx.HTTPError as error:
            raise ServerUnreachable(self._unreachable(error)) from None

    def follow(self, run_id: str, reconnect_s: float = 60.0) -> Iterator[SseEvent]:
        """The run's events until it finishes, reconnecting (with Last-Event-ID) when the stream
        ends before the run does: the server ends every stream after a while
        (KPO_STREAM_LIFETIME_S), and streams break while the control plane restarts. Gives up
        after `reconnect_s` without reaching the server.
        """
        last_id: str | None = None
        broken_since: float | None = None
        while True:
            wait_s = 1.0
            try:
                for event in self.events(run_id, last_id):
                    last_id = event.id or last_id
                    yield event
                    if event.kind == "status" and event.data.get("status") in TERMINAL:
                        return
                # The server ended the stream on its own: reconnect a second later, as its `retry:`
                # asks.
                broken_since = None
                time.sleep(wait_s)
                continue
            except ServerUnreachable as error:
                problem = str(error)
            except ApiError as error:
                if error.status < 500 and error.status != 429:  # wrong, and stays wrong
                    raise
                problem = str(error)
                wait_s = error.retry_after_s or wait_s
            broken_since = broken_since or time.monotonic()
            if time.monotonic() - broken_since > reconnect_s:
                raise ServerUnreachable(f"{problem}; gave up after {reconnect_s:.0f} s")
            time.sleep(min(wait_s, reconnect_s))

    # --- helpers -----------------------------------------------------------------------------

    def _call(self, method: str, path: str, **kwargs: Any) -> Any:
        try:
            response = self._http.request(method, path, **kwargs)
        except httpx.HTTPError as error:
            raise ServerUnreachable(self._unreachable(error)) from None
        if response.is_error:
            raise _api_error(response)
        return response.json()

    def _unreachable(self, error: Exception) -> str:
        return f"cannot reach the KPO server at {self.server}: {error or type(error).__name__}"


def _api_error(response: httpx.Response) -> ApiError:
    """The error a response carries: the message of its JSON body, or its text."""
    try:
        message = str(response.json()["error"]["message"])
    except (ValueError, KeyError, TypeError):
        message = response.text.strip()[:500] or response.reason_phrase
    retry_after = response.headers.get("retry-after", "")
    seconds = float(retry_after) if retry_after.isdigit() else None
    return ApiError(response.status_code, message, seconds)


def parse_sse(lines: Iterator[str]) -> Iterator[SseEvent]:
    """Server-sent events from the lines of a stream (comments, e.g. pings, are skipped)."""
    event_id: str | None = None
    kind = "message"
    data: list[str] = []
    for line in lines:
        if not line:
            if data:
                yield SseEvent(event_id, kind, json.loads("\n".join(data)))
            kind, data = "message", []
            continue
        if line.startswith(":"):
            continue
        field, _, value = line.partition(":")
        value = value.removeprefix(" ")
        if field == "id":
            event_id = value
        elif field == "event":
            kind = value
        elif field == "data":
            data.append(value)
