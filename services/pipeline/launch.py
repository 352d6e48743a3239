"""Running a spec end to end in this process: Ray, the driver, the output directory."""

from __future__ import annotations

import traceback
from collections.abc import Sequence

import ray

from kpo_core.config import RunSpec
from services.pipeline.actors import connect_ray
from services.pipeline.driver import RunDriver
from services.pipeline.outputs import RunDirectory, RunObserver, RunState

ERROR_FILE = "error.txt"


def execute_run(
    spec: RunSpec, run_dir: RunDirectory, observers: Sequence[RunObserver] = ()
) -> RunState:
    """Run (or resume, when `run_dir` holds a checkpoint) `spec`; the final state.

    A failure is recorded in status.json and its traceback in error.txt, then re-raised.
    """
    started_ray = not ray.is_initialized()
    connect_ray(spec)
    try:
        return RunDriver(spec, run_dir, observers).run()
    except Exception:
        (run_dir.path / ERROR_FILE).write_text(traceback.format_exc(), encoding="utf-8")
        raise
    finally:
        if started_ray:
            ray.shutdown()
