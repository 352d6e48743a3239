"""Flushing files and directories to disk, for writers that rename a finished directory into
place (checkpoints, model exports): after a crash or power loss, what the rename made visible
is whole on disk too."""

from __future__ import annotations

import os
from pathlib import Path


def fsync_path(path: Path) -> None:
    # A directory is opened read-only to sync its entries (the renames and new files in it).
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def sync_tree(directory: Path) -> None:
    """Flush every file and directory under `directory` to disk."""
    for path in sorted(directory.rglob("*"), reverse=True):
        fsync_path(path)
    fsync_path(directory)
