"""Fixtures of the store tests: a real redis-server, and a store of each backend.

`open_test_store` is parametrized over the backends; every test that uses it (or `store`) runs
once per backend. Each call of it opens a new store instance on the same data (a new LocalStore on
the same directory, a new RedisStore on the same server and key prefix), which is how the tests
check that a restart of the control plane loses nothing.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from services.store import LocalStore, RedisStore, Store
from tests.services.store.redis_server import RedisServer
from tests.services.store.support import StoreOpener

BACKENDS = ["local", "redis"]


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """One redis-server for the session; tests keep apart by key prefix. Never stop it in a test:
    use `own_redis_server` for that."""
    server = RedisServer(tmp_path_factory.mktemp("redis"))
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def own_redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    """A redis-server of this test's own, which the test may stop, kill and restart."""
    server = RedisServer(tmp_path / "redis")
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(params=BACKENDS)
def open_test_store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[StoreOpener]:
    """Opens stores of one backend on this test's data; options go to the store's constructor."""
    opened: list[Store] = []
    if request.param == "local":

        def make(**options: Any) -> Store:
            return LocalStore(tmp_path / "data", **options)
    else:
        server: RedisServer = request.getfixturevalue("redis_server")
        prefix = f"test-{uuid.uuid4().hex[:12]}"

        def make(**options: Any) -> Store:
            return RedisStore.from_url(server.url, prefix=prefix, **options)

    def open_store(**options: Any) -> Store:
        store = make(**options)
        opened.append(store)
        return store

    yield open_store
    for store in opened:
        store.close()


@pytest.fixture
def store(open_test_store: StoreOpener) -> Store:
    return open_test_store()
