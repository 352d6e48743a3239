"""Running a spec end to end in this process: Ray, the driver, the output directory."""

from __future__ import annotations

import signal
import traceback
from collections.abc import Callable, Sequence
from types import FrameType

import ray

from services.observers import RunObserver, RunState
from services.pipeline.actors import connect_ray
from services.pipeline.driver import RunDriver
from services.pipeline.outputs import RunDirectory
from services.pipeline.signals import on_stop_signals
from services.spec import RunSpec
from services.tracking import TrackingError, build_trackers

ERROR_FILE = "error.txt"


def execute_run(
    spec: RunSpec,
    run_dir: RunDirectory,
    observers: Sequence[RunObserver] = (),
    announce: Callable[[], None] = lambda: None,
) -> RunState:
    """Run (or resume, when `run_dir` holds a checkpoint) `spec`; the final state.

    `announce` is called first, once a cancel is already taken care of: a caller that tells the
    user the run is starting (`kpo run`) does it there, so that a Ctrl-C or SIGTERM right after
    the line is a recorded cancel, not a killed process.

    A failure is recorded in status.json and its traceback in error.txt, then re-raised.

    The experiment trackers of `spec.tracking` are observers too, started before Ray (a tracker
    that cannot start fails the run at once) and ended whatever way the run ends.
    """
    try:
        trackers = build_trackers(spec, run_dir.path)
    except TrackingError as error:
        (run_dir.path / ERROR_FILE).write_text(traceback.format_exc(), encoding="utf-8")
        for observer in (run_dir, *observers):
            observer.on_status("failed", str(error), step=0)
        raise
    try:
        return _execute_run(spec, run_dir, [*observers, *trackers], announce)
    finally:
        # A run that raised before the driver reported a final state ends its trackers' runs as
        # failed; after a final state this does nothing.
        for tracker in trackers:
            tracker.close()


def _execute_run(
    spec: RunSpec,
    run_dir: RunDirectory,
    observers: Sequence[RunObserver],
    announce: Callable[[], None],
) -> RunState:
    started_ray = not ray.is_initialized()
    try:
        # Until the driver handles signals itself, a cancel stops the run before it starts,
        # with a `cancelled` record rather than none.
        with on_stop_signals(_stop_before_start):
            announce()
            connect_ray(spec)
    except (Exception, SystemExit) as stop:
        if not _stopped_before_start(stop):
            raise
        for observer in (run_dir, *observers):
            observer.on_status("cancelled", "cancelled before the run started", step=0)
        if started_ray and ray.is_initialized():
            ray.shutdown()
        return "cancelled"
    try:
        return RunDriver(spec, run_dir, observers).run()
    except Exception:
        (run_dir.path / ERROR_FILE).write_text(traceback.format_exc(), encoding="utf-8")
        raise
    finally:
        if started_ray:
            ray.shutdown()


class _StoppedBeforeStart(Exception):
    """SIGINT or SIGTERM arrived while Ray was starting."""


def _stop_before_start(signum: int, frame: FrameType | None) -> None:
    raise _StoppedBeforeStart


def _stopped_before_start(error: BaseException) -> bool:
    """Whether `error` is (or wraps) a cancel before the start. Library code that was running
    when the signal arrived may wrap the handler's exception (pydantic-settings turns it into
    a SettingsError while it reads the environment). Starting a local Ray installs Ray's own
    SIGTERM handler, which exits with the signal number: that exit, too, is a cancel."""
    seen: BaseException | None = error
    while seen is not None:
        if isinstance(seen, _StoppedBeforeStart):
            return True
        if isinstance(seen, SystemExit) and seen.code == signal.SIGTERM:
            return True
        seen = seen.__cause__ or seen.__context__
    return False
