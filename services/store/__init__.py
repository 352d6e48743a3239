"""Run, metrics, event and log store of the control plane.

One interface (`Store`), two backends that pass one contract test suite:
`LocalStore` (SQLite under the data directory; the default, no server) and `RedisStore`
(production). `open_store(url, data_dir)` / `store_from_env()` choose between them.
"""

from services.store.base import MAX_LOG_LINES, Store
from services.store.errors import (
    BufferFull,
    IdempotencyConflict,
    InvalidCursor,
    InvalidTransition,
    QuotaExceeded,
    RunNotFound,
    StoreError,
    StoreUnavailable,
)
from services.store.factory import open_store, store_from_env
from services.store.lifecycle import ACTIVE_STATUSES, NEXT_STATUSES, TERMINAL_STATUSES
from services.store.local import LocalStore
from services.store.records import Event, RunRecord, RunStatus, Transition, event_id_order
from services.store.redis_store import RedisStore
from services.store.retry import RetryPolicy

__all__ = [
    "ACTIVE_STATUSES",
    "MAX_LOG_LINES",
    "NEXT_STATUSES",
    "TERMINAL_STATUSES",
    "BufferFull",
    "Event",
    "IdempotencyConflict",
    "InvalidCursor",
    "InvalidTransition",
    "LocalStore",
    "QuotaExceeded",
    "RedisStore",
    "RetryPolicy",
    "RunNotFound",
    "RunRecord",
    "RunStatus",
    "Store",
    "StoreError",
    "StoreUnavailable",
    "Transition",
    "event_id_order",
    "open_store",
    "store_from_env",
]
