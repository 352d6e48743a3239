"""How long a checkpoint holds the learner: until the checkpoint is complete (hashed, flushed,
renamed: the baseline) vs until the learner's ranks have written their part (the writer thread
then hashes and flushes while the learner steps), measured on the same learner in one run.

The learner's part is its real checkpoint (`LearnerCore.save_checkpoint`: model, AdamW state,
RNGs) of the run's model; the driver sees what this measures, polling `holds_learner`.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from functools import partial
from pathlib import Path

from services.learner.step import LearnerCore
from services.pipeline.checkpoint_writer import CheckpointWriter
from services.pipeline.checkpoints import checkpoint_name
from services.spec import RunSpec
from services.tasks.models import resolve_model

POLL_SECONDS = 0.001


def held_seconds(writer: CheckpointWriter, root: Path, step: int, core: LearnerCore) -> float:
    """Seconds from starting checkpoint `step` until the learner may take its next step."""
    started = time.perf_counter()
    # A rank writes its part in its own process while the driver goes on: here the writer
    # thread stands for it.
    writer.start(
        root, step, {"step": step}, lambda path: partial(core.save_checkpoint, path), keep=2
    )
    while writer.holds_learner:
        time.sleep(POLL_SECONDS)
    held = time.perf_counter() - started
    writer.result()
    return held


def checkpoint_hold(spec: RunSpec, checkpoints: int) -> dict[str, float]:
    """Median seconds the learner is held per checkpoint, baseline and released early."""
    model_dir = resolve_model(spec.model, spec.model_revision)
    algorithm = spec.algorithm.with_response_length(spec.generation.max_new_tokens)
    core = LearnerCore(model_dir, spec.learner, algorithm, spec.generation.temperature)
    medians: dict[str, float] = {}
    size = 0
    with tempfile.TemporaryDirectory() as out:
        root = Path(out)
        # Interleaved, so that both paths see the same page cache and disk load.
        held: dict[str, list[float]] = {"baseline": [], "released": []}
        for step in range(1, checkpoints + 1):
            for mode, writer in (
                ("baseline", CheckpointWriter(hold_learner_until_written=True)),
                ("released", CheckpointWriter()),
            ):
                held[mode].append(held_seconds(writer, root / mode, step, core))
                writer.close()
        last = root / "released" / checkpoint_name(checkpoints)
        size = sum(file.stat().st_size for file in last.rglob("*") if file.is_file())
        medians = {mode: statistics.median(seconds) for mode, seconds in held.items()}
    print(
        f"learner held per checkpoint ({size / 2**20:.1f} MiB, median of {checkpoints}): "
        f"{medians['baseline'] * 1e3:.1f} ms until complete (baseline), "
        f"{medians['released'] * 1e3:.1f} ms until its part is written: "
        f"{medians['baseline'] / medians['released']:.2f}x shorter",
        flush=True,
    )
    return medians
