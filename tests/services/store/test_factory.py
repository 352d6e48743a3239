"""Choosing a store from a URL and from the environment; the test Redis helper's failure mode."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.store import LocalStore, RedisStore, open_store, store_from_env
from tests.services.store.redis_server import RedisServer, free_port


def test_no_url_is_the_local_store_in_the_data_dir(tmp_path: Path) -> None:
    with open_store(None, tmp_path / "data") as store:
        assert isinstance(store, LocalStore)
        assert store.directory == tmp_path / "data"
        assert store.ping()
    with store_from_env({"KPO_DATA_DIR": str(tmp_path / "env-data")}) as store:
        assert isinstance(store, LocalStore)
        assert store.path.parent == tmp_path / "env-data"


def test_a_path_url_is_the_local_store_there(tmp_path: Path) -> None:
    with store_from_env(
        {"KPO_STORE_URL": str(tmp_path / "elsewhere"), "KPO_DATA_DIR": str(tmp_path)}
    ) as store:
        assert isinstance(store, LocalStore)
        assert store.directory == tmp_path / "elsewhere"


def test_a_redis_url_is_the_redis_store(redis_server: RedisServer) -> None:
    with store_from_env({"KPO_STORE_URL": redis_server.url}) as store:
        assert isinstance(store, RedisStore)
        assert store.ping()
    # Opening does not connect; an unreachable server shows as not ready.
    with open_store(f"redis://127.0.0.1:{free_port()}/0") as store:
        assert isinstance(store, RedisStore)
        assert store.ping() is False


def test_an_unknown_scheme_names_the_valid_ones() -> None:
    with pytest.raises(ValueError, match=r"use redis://HOST:PORT/DB, rediss://"):
        open_store("postgres://db/kpo")


def test_the_test_server_fails_with_the_install_hint_when_redis_is_missing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(RuntimeError, match="apt-get install redis-server"):
        RedisServer(tmp_path).start()


@pytest.mark.parametrize(
    "url",
    [
        "postgres://kpo:hunter2-secret@db/kpo",  # a scheme no store has
        "redis://:hunter2-secret@redis:notaport/0",  # redis-py cannot parse the port
        "rediss://admin:hunter2-secret@redis:99999/0",
        "redis://redis:6379/0?password=hunter2-secret&db=x",
    ],
)
def test_a_bad_store_url_is_named_without_its_password(url: str) -> None:
    with pytest.raises(ValueError, match="store URL") as raised:
        open_store(url)
    message = str(raised.value)
    assert "hunter2" not in message and "***" in message, message
    # Nor in a chained error that a traceback would print.
    assert raised.value.__cause__ is None
    assert raised.value.__context__ is None or raised.value.__suppress_context__
