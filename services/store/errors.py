"""Errors a store raises. The API maps them to HTTP statuses; each message names the run and why.

RunNotFound         -> 404
IdempotencyConflict -> 409 (or 422: the same key was used with another body)
InvalidTransition   -> 409
InvalidCursor       -> 400/422 (a list cursor or event id the store never handed out)
QuotaExceeded       -> 429 (as many runs as allowed are queued or running)
StoreUnavailable    -> 503 (the server behind the store cannot be reached right now)
"""

from __future__ import annotations


class StoreError(Exception):
    """Base of every error a store raises on purpose."""


class RunNotFound(StoreError, KeyError):
    """No run has this id."""

    def __init__(self, run_id: str) -> None:
        super().__init__(run_id)
        self.run_id = run_id

    def __str__(self) -> str:
        # KeyError would quote the whole message; say it plainly instead.
        return f"no run with id {self.run_id!r}"


class IdempotencyConflict(StoreError):
    """An idempotency key already created a run from a different spec."""

    def __init__(self, key: str, run_id: str) -> None:
        super().__init__(
            f"idempotency key {key!r} already created run {run_id!r} from a different spec; "
            "reuse a key only to resend the same request, or use a new key"
        )
        self.key = key
        self.run_id = run_id


class InvalidTransition(StoreError):
    """A status change the run lifecycle does not allow from the run's current status."""

    def __init__(self, run_id: str, current: str, requested: str, allowed: list[str]) -> None:
        allowed_text = ", ".join(allowed) if allowed else "none: the run has finished"
        super().__init__(
            f"run {run_id!r} is {current}; it cannot become {requested} "
            f"(allowed next statuses: {allowed_text})"
        )
        self.run_id = run_id
        self.current = current
        self.requested = requested


class QuotaExceeded(StoreError):
    """A new run would make more runs active (queued or running) than the caller allows."""

    def __init__(self, limit: int) -> None:
        super().__init__(
            f"{limit} runs are already queued or running, the most allowed at once; "
            "wait for one to finish, or cancel one"
        )
        self.limit = limit


class InvalidCursor(StoreError, ValueError):
    """A pagination cursor or event id that this store did not hand out."""


class StoreUnavailable(StoreError):
    """The store's server cannot be reached; nothing was read, or the write was not accepted."""


class BufferFull(StoreUnavailable):
    """The store is unreachable and its outage buffer is full: this write was not accepted."""
