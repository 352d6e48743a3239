"""The two ToolRunners the rollouts use: `HttpSandbox` (a sandbox server, over HTTP) and
`LocalSandbox` (sandboxed processes of this process, for single-machine runs). Neither ever
raises into the run: whatever goes wrong becomes a ToolResult whose status says what (and is
counted in `counts`).
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections import Counter
from typing import Any

import httpx

from services.tools.sandbox import (
    Backend,
    SandboxLimits,
    SandboxRunner,
    ToolResult,
    ToolStatus,
)

log = logging.getLogger(__name__)

# Transport failures worth another try: the server is restarting, not reachable yet, or died
# mid-call. A call is stateless (a fresh sandbox each time), so running it again is safe: the
# client still returns exactly one result for it.
RETRYABLE_ERRORS = (
    httpx.ConnectError,
    httpx.ConnectTimeout,
    httpx.ReadError,
    httpx.WriteError,
    httpx.RemoteProtocolError,
    httpx.PoolTimeout,
)
RETRYABLE_STATUSES = frozenset({408, 429, 502, 503, 504})
MAX_BACKOFF_S = 2.0


class _Counts:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: Counter[str] = Counter()

    def add(self, status: ToolStatus) -> None:
        with self._lock:
            self._counts[status] += 1

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self._counts)


class HttpSandbox:
    """A ToolRunner over `kpo sandbox serve` at `url` (http(s)://host:port).

    timeout_s: the call's wall clock, sent to the server. A connection failure, a server that
    died mid-call, 408 (the body came too slowly), 429 (busy) and 502/503/504 are retried with
    jittered exponential backoff (honouring Retry-After) for up to `retry_budget_s`; what still
    fails is status
    "unavailable". A request the server refuses (401, 413, 422) is "refused" (401 also logs an
    error: a wrong token is a configuration problem).
    """

    def __init__(
        self,
        url: str,
        token: str | None = None,
        timeout_s: float = 5.0,
        *,
        retry_budget_s: float = 30.0,
        queue_wait_s: float = 60.0,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        self.url = url.rstrip("/")
        self.timeout_s = timeout_s
        self.retry_budget_s = retry_budget_s
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        # Reading waits for the call itself and its place in the server's queue.
        read_s = timeout_s + queue_wait_s
        self._client = httpx.Client(
            headers=headers,
            timeout=httpx.Timeout(read_s, connect=min(5.0, retry_budget_s + 0.1)),
            transport=transport,
        )
        self._counts = _Counts()
        self.retries = 0

    @property
    def counts(self) -> dict[str, int]:
        return self._counts.snapshot()

    @property
    def closed(self) -> bool:
        return self._client.is_closed

    def close(self) -> None:
        self._client.close()

    def __enter__(self) -> HttpSandbox:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def run(self, code: str) -> ToolResult:
        started = time.monotonic()
        try:
            result = self._call(code, started)
        except Exception as exc:  # never into the run: an observation instead
            log.exception("sandbox call failed")
            result = ToolResult(f"{type(exc).__name__}", "unavailable", 0.0)
        result = ToolResult(
            result.output, result.status, time.monotonic() - started, result.timeout_s
        )
        self._counts.add(result.status)
        return result

    def _call(self, code: str, started: float) -> ToolResult:
        deadline = started + self.retry_budget_s
        attempt = 0
        body = {"code": code, "timeout_s": self.timeout_s}
        last = "no attempt"
        while True:
            wait: float | None = None
            try:
                response = self._client.post(f"{self.url}/v1/run", json=body)
            except RETRYABLE_ERRORS as exc:
                last = f"{type(exc).__name__}: {exc}"
            except httpx.TimeoutException as exc:
                # The server took the call and never answered within the read timeout: a
                # retry would likely wait as long again.
                return ToolResult(f"{type(exc).__name__}", "unavailable", 0.0)
            else:
                if response.status_code == 200:
                    return _parse(response.json())
                if response.status_code in RETRYABLE_STATUSES:
                    last = f"HTTP {response.status_code}"
                    wait = _retry_after(response.headers.get("retry-after"))
                elif response.status_code in (401, 403):
                    log.error("sandbox server at %s refused the token", self.url)
                    return ToolResult("sandbox token refused", "refused", 0.0)
                elif response.status_code in (413, 422):
                    return ToolResult(_detail(response), "refused", 0.0)
                else:
                    return ToolResult(f"HTTP {response.status_code}", "unavailable", 0.0)
            attempt += 1
            self.retries += 1
            backoff = min(MAX_BACKOFF_S, 0.05 * 2**attempt) * (0.5 + random.random())
            pause = max(backoff, wait or 0.0)
            if time.monotonic() + pause > deadline:
                log.warning("sandbox at %s unavailable after %d tries: %s", self.url, attempt, last)
                return ToolResult(last, "unavailable", 0.0)
            time.sleep(pause)  # backoff between retries, not synchronisation


def _retry_after(value: str | None) -> float | None:
    try:
        return min(MAX_BACKOFF_S * 5, max(0.0, float(value))) if value else None
    except ValueError:
        return None


def _detail(response: httpx.Response) -> str:
    try:
        detail: Any = response.json().get("detail", "")
    except ValueError:
        detail = response.text
    return str(detail)[:500] or f"HTTP {response.status_code}"


def _parse(payload: dict[str, Any]) -> ToolResult:
    status = payload.get("status")
    if status not in ("ok", "error", "timeout", "refused", "unavailable"):
        return ToolResult(f"bad status {status!r} from the sandbox", "unavailable", 0.0)
    return ToolResult(
        str(payload.get("output", "")),
        status,
        float(payload.get("seconds", 0.0)),
        payload.get("timeout_s"),
    )


class LocalSandbox:
    """A ToolRunner without a server: each call a sandboxed process of this process
    (single-machine runs). `run` blocks its caller for one call; at most `max_concurrency` run
    at once (a further caller waits for a slot). The threads are the caller's: rollouts call it
    from `ToolCalls`, whose pool has as many threads as this has slots, so the pool's bound is
    the only one a call meets."""

    def __init__(
        self,
        backend: Backend = "bwrap",
        limits: SandboxLimits | None = None,
        *,
        allow_unsafe_process: bool = False,
        max_concurrency: int = 4,
    ) -> None:
        self._runner = SandboxRunner(
            backend, limits, allow_unsafe_process=allow_unsafe_process, slots=max_concurrency
        )
        self._counts = _Counts()

    @property
    def counts(self) -> dict[str, int]:
        return self._counts.snapshot()

    def run(self, code: str) -> ToolResult:
        try:
            result = self._runner.run(code)
        except Exception as exc:  # never into the run
            log.exception("local sandbox call failed")
            result = ToolResult(f"{type(exc).__name__}: {exc}", "unavailable", 0.0)
        self._counts.add(result.status)
        return result

    def close(self) -> None:
        """Nothing to release: each call's process ends with the call."""

    def __enter__(self) -> LocalSandbox:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()
