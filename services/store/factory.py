"""Choosing a store: by URL, and from the environment (the only place that reads it)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

from services.store.base import Store
from services.store.local import LocalStore
from services.store.redis_store import RedisStore

DEFAULT_DATA_DIR = "~/.kpo"
REDIS_SCHEMES = ("redis://", "rediss://", "unix://")


def open_store(url: str | None, data_dir: Path | str = DEFAULT_DATA_DIR) -> Store:
    """The store that `url` names.

    `redis://...`, `rediss://...` (TLS) or `unix://...` selects Redis; a filesystem path selects
    the local store in that directory; None or "" selects the local store in `data_dir`.
    """
    if not url:
        return LocalStore(Path(data_dir).expanduser())
    if url.startswith(REDIS_SCHEMES):
        return RedisStore.from_url(url)
    if "://" in url:
        raise ValueError(
            f"store URL {url!r}: use redis://HOST:PORT/DB, rediss://... (TLS), unix://PATH, "
            "or a directory path for the local store"
        )
    return LocalStore(Path(url).expanduser())


def store_from_env(environ: Mapping[str, str] | None = None) -> Store:
    """The store that `KPO_STORE_URL` names (default: local, in `KPO_DATA_DIR`, else ~/.kpo)."""
    env = os.environ if environ is None else environ
    return open_store(env.get("KPO_STORE_URL"), env.get("KPO_DATA_DIR") or DEFAULT_DATA_DIR)
