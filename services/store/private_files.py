"""Directories and files of this user only: the data directory (0700) and the SQLite store's
files (0600, its WAL and shared-memory files included).

Runs' specs, metrics, logs and the Ray head's record are no other local user's to read; a
process umask (022 by default) would leave them world-readable.
"""

from __future__ import annotations

import os
import stat
from contextlib import suppress
from pathlib import Path

PRIVATE_DIR_MODE = 0o700
PRIVATE_FILE_MODE = 0o600


def private_directory(path: Path) -> Path:
    """`path` made (with its parents) as a directory of this user only, or, if it exists and
    is ours, tightened to 0700. One of another user's is left as it is (its owner decides)."""
    path.mkdir(mode=PRIVATE_DIR_MODE, parents=True, exist_ok=True)
    _tighten(path, PRIVATE_DIR_MODE)
    return path


def private_file(path: Path, *, create: bool = True) -> None:
    """`path` made as an empty file of this user only if it is missing (unless not `create`),
    else tightened to 0600 when it is ours."""
    with suppress(FileExistsError):
        if create:
            os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, PRIVATE_FILE_MODE))
    with suppress(FileNotFoundError):
        _tighten(path, PRIVATE_FILE_MODE)


def _tighten(path: Path, mode: int) -> None:
    st = os.stat(path)
    if st.st_uid == os.getuid() and stat.S_IMODE(st.st_mode) != mode:
        os.chmod(path, mode)
