"""Export a run's checkpoint as a Hugging Face model directory (`kpo export RUN_DIR`).

The run directory's layout (its checkpoints, which of them are intact, where the model goes) is
the pipeline's; turning one learner checkpoint into a model directory is the learner's
(`services.learner.export.export_model`).
"""

from __future__ import annotations

import logging
from pathlib import Path

from services.learner.export import ExportError, export_model
from services.pipeline.checkpoints import (
    LEARNER_DIR,
    latest_checkpoint,
    list_checkpoints,
    verify_checkpoint,
)
from services.pipeline.outputs import CHECKPOINTS_DIR, MODEL_DIR

log = logging.getLogger(__name__)


def export_run(run_dir: Path, out_dir: Path | None = None, step: int | None = None) -> Path:
    """Export the checkpoint of `step` of a run (default: the newest intact one); return where.

    `out_dir` defaults to RUN_DIR/model.
    """
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise ExportError(f"{run_dir}: no such run directory")
    root = run_dir / CHECKPOINTS_DIR
    checkpoints = dict(list_checkpoints(root))
    if step is None:
        latest = latest_checkpoint(root)
        if latest is None:
            found = f"only damaged ones (steps {_steps(checkpoints)})" if checkpoints else "none"
            raise ExportError(f"{run_dir} has no complete checkpoint in {root}: {found}")
        step, path = latest
    elif step not in checkpoints:
        raise ExportError(
            f"{run_dir} has no checkpoint of step {step} (steps: {_steps(checkpoints) or 'none'})"
        )
    else:
        path = checkpoints[step]
        problem = verify_checkpoint(path)
        if problem is not None:
            raise ExportError(f"checkpoint {path} is damaged: {problem}")
    out_dir = out_dir or run_dir / MODEL_DIR
    if out_dir.resolve().is_relative_to(root.resolve()):
        # A file there would not match its checkpoint's manifest: resume would skip it.
        raise ExportError(f"{out_dir} is inside the checkpoints of {run_dir}; pick another output")
    log.info("exporting step %d of %s", step, run_dir)
    return export_model(path / LEARNER_DIR, out_dir)


def _steps(checkpoints: dict[int, Path]) -> str:
    return ", ".join(str(step) for step in sorted(checkpoints))
