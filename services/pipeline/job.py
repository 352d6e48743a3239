"""A stored run executed as one process: what the Ray job of a run (`kpo execute RUN_ID`) does.

The control plane stores the run (`queued`, with its resolved spec) and submits a Ray job whose
entrypoint is `kpo execute RUN_ID`. That process reads the spec back from the store, runs it into
`<data dir>/runs/<RUN_ID>/` and reports to the store through a `StoreObserver`, next to the
usual progress lines (which become the job's log). If the directory already holds a checkpoint,
the job was restarted: the run resumes from it, as `kpo resume` would.

SIGTERM, which Ray's `stop_job` sends, is the driver's cancel: it finishes the current learner
step, writes a checkpoint and reports `cancelled`.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import time
import traceback
from pathlib import Path
from typing import TextIO

from services.observers import RunState
from services.pipeline.checkpoints import latest_checkpoint
from services.pipeline.launch import execute_run
from services.pipeline.outputs import ProgressPrinter, RunDirectory
from services.pipeline.specs import SpecError, parse_run_spec, preflight
from services.pipeline.store_observer import StoreObserver
from services.store import RunRecord, Store, StoreUnavailable
from services.store.lifecycle import TERMINAL_STATUSES

log = logging.getLogger(__name__)

RUNS_DIR = "runs"
# How long a starting job waits for an unreachable store (a Redis restart) before giving up.
STORE_WAIT_S = 60.0
# How long a finished job keeps trying to store writes buffered during an outage.
FLUSH_TIMEOUT_S = 60.0


def run_output_dir(data_dir: Path, run_id: str) -> Path:
    """Where the run with this id writes its outputs: `<data dir>/runs/<run id>`."""
    return Path(data_dir).expanduser() / RUNS_DIR / run_id


def execute_stored_run(
    store: Store,
    run_id: str,
    data_dir: Path,
    stream: TextIO = sys.stdout,
    store_wait_s: float = STORE_WAIT_S,
    flush_timeout_s: float = FLUSH_TIMEOUT_S,
) -> RunState:
    """Run (or resume) the stored run `run_id`; its final state.

    A spec that does not validate marks the run `failed` with the message. A run that is already
    finished is left as it is. Raises `RunNotFound` for an unknown run and `StoreUnavailable` if
    the store cannot be read within `store_wait_s`.
    """
    run = _get_run(store, run_id, store_wait_s)
    if run.status in TERMINAL_STATUSES:
        print(f"[kpo] run {run_id} is {run.status.value} already: nothing to do", file=stream)
        return run.status.value
    try:
        spec = parse_run_spec(dict(run.spec), f"run {run_id}: spec")
        preflight(spec, f"run {run_id}: spec")
    except SpecError as error:
        observer = StoreObserver(store, run_id, total_steps=1)
        observer.on_status("failed", str(error))
        print(f"[kpo] run failed: {error}", file=stream, flush=True)
        _flush(store, flush_timeout_s)
        return "failed"
    run_dir = RunDirectory(run_output_dir(data_dir, run_id))
    if latest_checkpoint(run_dir.checkpoints) is not None:
        print(f"[kpo] {run_dir.path} holds a checkpoint: resuming from it", file=stream)
    run_dir.write_config(spec.model_dump(mode="json"))
    print(f"[kpo] run {run_id} ({spec.name!r}) -> {run_dir.path}", file=stream, flush=True)
    steps = spec.pipeline.steps
    observer = StoreObserver(store, run_id, steps, on_finished_elsewhere=_cancel_this_process)
    try:
        state = execute_run(spec, run_dir, [ProgressPrinter(steps, stream), observer])
    except Exception as error:
        traceback.print_exc(file=stream)
        if observer.final_state is None:  # it failed before the driver could say so
            observer.on_status("failed", f"{type(error).__name__}: {error}")
        state = "failed"
    _flush(store, flush_timeout_s)
    return state


def _get_run(store: Store, run_id: str, wait_s: float) -> RunRecord:
    """The stored run, retrying while the store is unreachable (a Redis restart) for `wait_s`."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            return store.get_run(run_id)
        except StoreUnavailable as error:
            if time.monotonic() > deadline:
                raise
            log.warning("the store is unreachable (%s); trying again", error)
            time.sleep(1.0)


def _flush(store: Store, timeout_s: float) -> None:
    """Store what was buffered during an outage; say so loudly if some of it could not be."""
    if not store.flush(timeout_s):
        log.error(
            "%d buffered store writes could not be stored within %.0f s; the run's output "
            "directory has every record",
            store.pending_writes,
            timeout_s,
        )


def _cancel_this_process() -> None:
    """Ask the driver to stop: the run was finished (cancelled) by the control plane already.

    The driver treats SIGTERM as a cancel request; this runs on the driver's own thread, inside
    its signal handling, so the signal reaches that handler.
    """
    os.kill(os.getpid(), signal.SIGTERM)
