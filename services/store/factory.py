"""Choosing a store: by URL, and from the environment (the only place that reads it)."""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from pathlib import Path

from services.store.base import Store
from services.store.local import LocalStore
from services.store.redis_store import RedisStore

DEFAULT_DATA_DIR = "~/.kpo"
REDIS_SCHEMES = ("redis://", "rediss://", "unix://")
# The password of a URL's user info (`scheme://user:PASSWORD@host`), up to the last `@`: a
# password with an unescaped `@` is hidden whole, at worst with more of the URL.
_USERINFO_PASSWORD = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*://[^:/@]*):.*@")
# redis-py also reads a password from the query string (`?password=...`).
_QUERY_PASSWORD = re.compile(r"([?&]password=)[^&#]*", re.IGNORECASE)


def redacted_url(url: str) -> str:
    """`url` with its password, if any, replaced by `***`: what an error may show of it."""
    url = _USERINFO_PASSWORD.sub(r"\1:***@", url)
    return _QUERY_PASSWORD.sub(r"\1***", url)


def open_store(url: str | None, data_dir: Path | str = DEFAULT_DATA_DIR) -> Store:
    """The store that `url` names.

    `redis://...`, `rediss://...` (TLS) or `unix://...` selects Redis; a filesystem path selects
    the local store in that directory; None or "" selects the local store in `data_dir`.
    Raises ValueError for a URL it cannot use; the message never holds the URL's password.
    """
    if not url:
        return LocalStore(Path(data_dir).expanduser())
    if url.startswith(REDIS_SCHEMES):
        try:
            return RedisStore.from_url(url)
        except ValueError as error:  # redis-py's parse errors: a port, a db number, IPv6
            raise ValueError(f"store URL {redacted_url(url)!r}: {error}") from None
    if "://" in url:
        raise ValueError(
            f"store URL {redacted_url(url)!r}: use redis://HOST:PORT/DB, rediss://... (TLS), "
            "unix://PATH, or a directory path for the local store"
        )
    return LocalStore(Path(url).expanduser())


def store_from_env(environ: Mapping[str, str] | None = None) -> Store:
    """The store that `KPO_STORE_URL` names (default: local, in `KPO_DATA_DIR`, else ~/.kpo)."""
    env = os.environ if environ is None else environ
    return open_store(env.get("KPO_STORE_URL"), env.get("KPO_DATA_DIR") or DEFAULT_DATA_DIR)
