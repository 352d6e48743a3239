"""Running the cells: one pipeline run per (cell, seed), then its held-out evaluations.

Each run lives in `<out>/runs/<cell>/seed-<n>/` (the pipeline's run directory: metrics.jsonl,
config.json, ratios/, curves.png) plus `evals.json` (held-out accuracy by step, and the run's
seconds including its evaluations), which is written last and marks the run finished. A study
that is interrupted picks up at the first unfinished run; a half-written run is started again
from scratch, so every finished run is one uninterrupted run.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from services.learner.export import export_model
from services.observers import MetricsRecord
from services.pipeline.checkpoints import LEARNER_DIR, list_checkpoints
from services.pipeline.launch import execute_run
from services.pipeline.outputs import (
    CHECKPOINTS_DIR,
    MODEL_DIR,
    STATUS_FILE,
    RunDirectory,
    read_metrics,
)
from services.spec import RunSpec
from stability_study.evaluate import Evaluation
from stability_study.grid import Cell, cell_spec

EVALS_FILE = "evals.json"


@dataclass(frozen=True)
class RunResult:
    """One finished run: its per-step records and held-out evaluations by step (0 = start)."""

    cell: Cell
    seed: int
    path: Path
    records: list[MetricsRecord]
    evaluations: dict[int, Evaluation]
    seconds: float  # the run and its evaluations

    @property
    def accuracy(self) -> dict[int, float]:
        return {step: e.accuracy for step, e in self.evaluations.items()}


def run_path(out: Path, cell: Cell, seed: int) -> Path:
    return out / "runs" / cell.key / f"seed-{seed}"


def load_result(out: Path, cell: Cell, seed: int) -> RunResult | None:
    """The finished run of (cell, seed) under `out`, or None if it has not finished."""
    path = run_path(out, cell, seed)
    try:
        evals = json.loads((path / EVALS_FILE).read_text(encoding="utf-8"))
        evaluations = {
            int(step): Evaluation(**{k: float(v) for k, v in values.items()})
            for step, values in evals["evaluations"].items()
        }
        seconds = float(evals["seconds"])
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    return RunResult(cell, seed, path, read_metrics(path), evaluations, seconds)


def run_status(path: Path) -> dict[str, Any]:
    """The status.json of the run in `path` ({} when there is none yet, or it is unreadable)."""
    try:
        status = json.loads((path / STATUS_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return status if isinstance(status, dict) else {}


def stopped_unstable(path: Path) -> bool:
    """Whether the run in `path` was stopped by its stability guard after its last rollback:
    an outcome of the guard phase, evaluated like a finished run."""
    guard = run_status(path).get("guard")
    return isinstance(guard, dict) and guard.get("action") == "stop_unstable"


def _write_json(path: Path, data: Any) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(data, indent=1), encoding="utf-8")
    os.replace(tmp, path)


def run_one(
    base: RunSpec,
    cell: Cell,
    seed: int,
    out: Path,
    initial: Evaluation,
    evaluate: Callable[[Path], Evaluation],
) -> RunResult:
    """Run (cell, seed) to its last step, evaluate each checkpoint, and record the result.

    Checkpoints (and the run's final export) are deleted once evaluated: the study keeps
    metrics, ratios and evaluations.
    """
    started = time.perf_counter()
    path = run_path(out, cell, seed)
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True)
    spec = cell_spec(base, cell, seed)
    state = execute_run(spec, RunDirectory(path))
    if state != "succeeded" and not stopped_unstable(path):
        raise RuntimeError(f"run {cell.key} seed {seed} ended {state}; see {path}")
    evaluations = {0: initial}
    checkpoints = path / CHECKPOINTS_DIR
    for step, checkpoint in list_checkpoints(checkpoints):
        # Each checkpoint evaluated as the Hugging Face model it exports to.
        with tempfile.TemporaryDirectory() as tmp:
            evaluations[step] = evaluate(export_model(checkpoint / LEARNER_DIR, Path(tmp) / "m"))
    shutil.rmtree(checkpoints, ignore_errors=True)
    shutil.rmtree(path / MODEL_DIR, ignore_errors=True)
    seconds = time.perf_counter() - started
    evals = {
        "evaluations": {str(step): e.as_json() for step, e in evaluations.items()},
        "seconds": seconds,
    }
    _write_json(path / EVALS_FILE, evals)
    return RunResult(cell, seed, path, read_metrics(path), evaluations, seconds)
