"""The local store's files are this user's only: the data directory 0700, the SQLite database
and its WAL and shared-memory files 0600, whatever the process umask; files of an earlier
release, made world-readable, are tightened when the store next opens them."""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest

from services.store import LocalStore
from services.store.sqlite_schema import DB_FILE_NAME, SIDE_FILE_NAMES


@pytest.fixture
def default_umask() -> Iterator[None]:
    """The usual umask (022), under which files are made world-readable."""
    previous = os.umask(0o022)
    try:
        yield
    finally:
        os.umask(previous)


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def store_file_modes(directory: Path) -> dict[str, int]:
    return {name: mode(directory / name) for name in (DB_FILE_NAME, *SIDE_FILE_NAMES)}


@pytest.mark.usefixtures("default_umask")
def test_a_new_store_is_private(tmp_path: Path) -> None:
    directory = tmp_path / "data" / "store"
    store = LocalStore(directory)
    run = store.create_run({"steps": 1})
    store.append_metrics(run.id, [{"step": 1, "reward": 0.5}])
    assert mode(directory) == 0o700
    # The WAL and shared-memory files exist while a connection is open.
    assert store_file_modes(directory) == dict.fromkeys((DB_FILE_NAME, *SIDE_FILE_NAMES), 0o600)
    store.close()


@pytest.mark.usefixtures("default_umask")
def test_a_world_readable_store_is_tightened_when_opened(tmp_path: Path) -> None:
    first = LocalStore(tmp_path)
    first.create_run({"steps": 1})
    # As an earlier release left them, with a connection still open (the WAL kept).
    tmp_path.chmod(0o755)
    for name in (DB_FILE_NAME, *SIDE_FILE_NAMES):
        (tmp_path / name).chmod(0o644)

    second = LocalStore(tmp_path)
    assert len(second.list_runs(None, 10, None)[0]) == 1  # nothing lost
    assert mode(tmp_path) == 0o700
    assert store_file_modes(tmp_path) == dict.fromkeys((DB_FILE_NAME, *SIDE_FILE_NAMES), 0o600)
    first.close()
    second.close()
