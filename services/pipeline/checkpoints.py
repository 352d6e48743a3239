"""Checkpoint directories: written whole or not at all, found by step, pruned to the newest few.

Layout of one checkpoint, `checkpoints/step-00000010/`:
    learner/            the learner's part (a loadable model directory, optimiser, RNG state)
    driver_state.json   step, data position, rollout buffer contents, counters
    manifest.json       written last: the step, and the size and SHA-256 of every file

Everything is written into a hidden temporary directory, flushed to disk (fsync) and renamed
into place at the end, so a crash or power loss mid-write leaves no directory that looks
complete; a checkpoint whose files do not match its manifest (missing, truncated, or with
changed bytes) is skipped with a message, falling back to the previous one.

Every byte is hashed once, by the thread that writes the checkpoint: the driver's state as it is
written, the learner's files once its ranks have written them. A finished run exports the
checkpoint it just wrote on those digests; files are hashed again only to load a checkpoint
(`verify_checkpoint`: resume, export of an earlier run), where a damaged one must be caught.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import threading
from collections.abc import Callable, Collection
from pathlib import Path
from typing import Any

from services.durable_files import fsync_path, sync_tree

log = logging.getLogger(__name__)

MANIFEST = "manifest.json"
DRIVER_STATE = "driver_state.json"
LEARNER_DIR = "learner"
_PREFIX = "step-"


def checkpoint_name(step: int) -> str:
    return f"{_PREFIX}{step:08d}"


def _files(directory: Path) -> dict[str, Path]:
    return {
        str(path.relative_to(directory)): path
        for path in sorted(directory.rglob("*"))
        if path.is_file() and path.name != MANIFEST
    }


class HashTally:
    """Bytes this process has SHA-256-hashed for checkpoints (a written checkpoint's once)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._bytes = 0

    @property
    def bytes(self) -> int:
        return self._bytes

    def add(self, count: int) -> None:
        with self._lock:
            self._bytes += count


HASHED = HashTally()


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
            HASHED.add(len(chunk))
    return digest.hexdigest()


def _write_hashed(path: Path, data: bytes) -> dict[str, Any]:
    """Write `data` to `path`; its manifest entry, hashed from the bytes in memory."""
    path.write_bytes(data)
    HASHED.add(len(data))
    return {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}


def begin_checkpoint(root: Path, step: int) -> Path:
    """The empty hidden directory checkpoint `step` is written into (see `finish_checkpoint`)."""
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f".tmp-{checkpoint_name(step)}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    return tmp


def finish_checkpoint(root: Path, step: int, tmp: Path, driver_state: dict[str, Any]) -> Path:
    """Complete checkpoint `step` from `tmp` (its learner part written): the driver's state,
    the manifest of every file's size and digest, flushed and renamed into place."""
    files = {DRIVER_STATE: _write_hashed(tmp / DRIVER_STATE, json.dumps(driver_state).encode())}
    for name, path in _files(tmp).items():
        if name not in files:  # the learner's files, written by its ranks
            files[name] = {"size": path.stat().st_size, "sha256": _sha256(path)}
    manifest = {"step": step, "files": dict(sorted(files.items()))}
    (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1), encoding="utf-8")
    sync_tree(tmp)
    final = root / checkpoint_name(step)
    if final.exists():  # a checkpoint of the same step from an earlier, interrupted attempt
        shutil.rmtree(final)
    os.replace(tmp, final)
    fsync_path(root)
    return final


def write_checkpoint(
    root: Path,
    step: int,
    driver_state: dict[str, Any],
    write_learner: Callable[[Path], object],
) -> Path:
    """Write checkpoint `step` under `root` atomically; `write_learner(dir)` fills `learner/`."""
    tmp = begin_checkpoint(root, step)
    write_learner(tmp / LEARNER_DIR)
    return finish_checkpoint(root, step, tmp, driver_state)


def verify_checkpoint(path: Path) -> str | None:
    """None if the checkpoint at `path` is complete and intact, else what is wrong with it.

    Sizes are compared first (cheap), then SHA-256 digests. Manifests written before digests
    were recorded ({name: size}) are checked by size only.
    """
    try:
        manifest = json.loads((path / MANIFEST).read_text(encoding="utf-8"))
        expected = {
            name: entry if isinstance(entry, dict) else {"size": entry}
            for name, entry in manifest["files"].items()
        }
        sizes = {name: int(entry["size"]) for name, entry in expected.items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as error:
        return f"unreadable manifest: {error}"
    files = _files(path)
    actual = {name: file.stat().st_size for name, file in files.items()}
    if actual != sizes:
        missing = sorted(sizes.keys() - actual.keys())
        changed = sorted(k for k in sizes.keys() & actual.keys() if sizes[k] != actual[k])
        return f"files differ from the manifest (missing {missing}, wrong size {changed})"
    corrupt = [
        name
        for name, entry in expected.items()
        if "sha256" in entry and _sha256(files[name]) != entry["sha256"]
    ]
    if corrupt:
        return f"files differ from their SHA-256 in the manifest: {corrupt}"
    return None


def list_checkpoints(root: Path) -> list[tuple[int, Path]]:
    """(step, path) of every checkpoint directory under `root`, oldest first, unverified."""
    found = []
    for path in root.glob(f"{_PREFIX}*") if root.is_dir() else ():
        suffix = path.name.removeprefix(_PREFIX)
        if path.is_dir() and suffix.isdigit():
            found.append((int(suffix), path))
    return sorted(found)


def latest_checkpoint(root: Path) -> tuple[int, Path] | None:
    """The newest complete checkpoint; incomplete ones are skipped with a warning."""
    for step, path in reversed(list_checkpoints(root)):
        problem = verify_checkpoint(path)
        if problem is None:
            return step, path
        log.warning("skipping checkpoint %s: %s", path, problem)
    return None


def prune_checkpoints(root: Path, keep: int, protect: Collection[int] = ()) -> None:
    """Delete all but the newest `keep` checkpoints and those of the steps in `protect` (the
    stability guard's healthy one), and leftovers of interrupted writes."""
    for leftover in root.glob(".tmp-*"):
        shutil.rmtree(leftover, ignore_errors=True)
    for step, path in list_checkpoints(root)[:-keep]:
        if step not in protect:
            shutil.rmtree(path, ignore_errors=True)


def discard_checkpoints_after(root: Path, step: int) -> list[int]:
    """Delete the checkpoints of steps after `step` (a rollback's abandoned steps: a resume
    must never pick one); the steps deleted."""
    discarded = []
    for at, path in list_checkpoints(root):
        if at > step:
            shutil.rmtree(path, ignore_errors=True)
            discarded.append(at)
    return discarded


def checkpoint_at(root: Path, step: int) -> Path:
    """The complete checkpoint of `step` (FileNotFoundError naming what is wrong otherwise)."""
    path = root / checkpoint_name(step)
    problem = verify_checkpoint(path) if path.is_dir() else "it is not there"
    if problem is not None:
        raise FileNotFoundError(f"checkpoint {path} cannot be resumed from: {problem}")
    return path


def read_driver_state(path: Path) -> dict[str, Any]:
    state: dict[str, Any] = json.loads((path / DRIVER_STATE).read_text(encoding="utf-8"))
    return state
