"""curves.png: the training curves a person looks at first."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from services.pipeline.outputs import MetricsRecord

# (panel title, metrics keys drawn in it)
PANELS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("reward", ("reward_mean", "accuracy")),
    ("entropy", ("entropy",)),
    ("clip fraction", ("clip_fraction",)),
    ("staleness (versions)", ("staleness_mean", "staleness_max")),
)


def plot_curves(records: Sequence[MetricsRecord], path: Path, title: str = "") -> Path:
    """Draw reward, entropy, clip fraction and staleness against the learner step into `path`."""
    # Imported here, with a file-only backend: plotting is the only thing that needs matplotlib,
    # and a run on a machine without a display must not try to open one.
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(2, 2, figsize=(10, 7), sharex=True)
    steps = [r["step"] for r in records]
    for axis, (panel, keys) in zip(axes.flat, PANELS, strict=True):
        for key in keys:
            values = [r.get(key) for r in records]
            points = [(s, v) for s, v in zip(steps, values, strict=True) if v is not None]
            if points:
                axis.plot(*zip(*points, strict=True), label=key, linewidth=1.2)
        axis.set_title(panel)
        axis.grid(alpha=0.3)
        if len(keys) > 1:
            axis.legend(fontsize=8)
    for axis in axes[1]:
        axis.set_xlabel("learner step")
    figure.suptitle(title)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path
