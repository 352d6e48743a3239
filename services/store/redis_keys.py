"""Names of the Redis store's keys.

Layout under the key prefix P (default `kpo`):

    P:run:<id>            hash    the run: id, status, spec, spec_hash, created_at, transitions
                                  (JSON), error, seq (creation order), last_step; once a cancel
                                  was requested, cancel_requested_at; once its driver was
                                  started again, driver_restarts; and, for a run made with a
                                  key, idem (that key's name) and idem_ttl_ms
    P:run:<id>:metrics    stream  one entry per metrics record, entry id `<step>-1`
    P:run:<id>:events     stream  the run's events (`k` kind, `d` JSON data, `t` time)
    P:run:<id>:logs       list    the last `max_log_lines` log lines
    P:runs, P:runs:<st>   zsets   every run / the runs with status <st>, scored by seq
    P:runs:seq            counter the last seq handed out
    P:idem:<key>          string  the run an idempotency key created; expires idem_ttl_ms
                                  after that run finished
    P:op:<token>          string  a write (not metrics) that was made, for a day (see
                                  `redis_scripts`)
"""

from __future__ import annotations

import uuid

from services.store.base import RUN_ID_PATTERN
from services.store.errors import RunNotFound
from services.store.records import RunStatus


class RedisKeys:
    """Key names under one prefix."""

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        self.runs = f"{prefix}:runs"
        self.seq = f"{prefix}:runs:seq"
        self.run_prefix = f"{prefix}:run:"
        self.status_prefix = f"{prefix}:runs:"

    def run(self, run_id: str) -> str:
        """The run's hash; `RunNotFound` for an id this store cannot have made, so that no
        request can name another kind of key."""
        if not RUN_ID_PATTERN.fullmatch(run_id):
            raise RunNotFound(run_id)
        return self.run_prefix + run_id

    def metrics(self, run_id: str) -> str:
        return f"{self.run(run_id)}:metrics"

    def events(self, run_id: str) -> str:
        return f"{self.run(run_id)}:events"

    def logs(self, run_id: str) -> str:
        return f"{self.run(run_id)}:logs"

    def by_status(self, status: RunStatus) -> str:
        return self.status_prefix + status.value

    def idempotency(self, key: str) -> str:
        return f"{self.prefix}:idem:{key}"

    def new_op(self) -> str:
        return f"{self.prefix}:op:{uuid.uuid4().hex}"
