"""curves.png: the training curves a person looks at first."""

from __future__ import annotations

import argparse
import math
import os
from collections.abc import Sequence
from pathlib import Path

from services.metrics import RECORD
from services.observers import MetricsRecord
from services.pipeline.outputs import CURVES_FILE, read_metrics

# curves.png's panels, in drawing order (left to right, top to bottom), and whether a trend line
# is drawn over the noisy values. The keys a panel draws are those services/metrics.py declares
# with the panel's title as `plot`.
TRENDS = {
    "reward": True,
    "entropy": True,
    "clip fraction": True,
    "staleness (versions)": False,
    "tools": True,
}


def _panels() -> tuple[tuple[str, tuple[str, ...], bool], ...]:
    """(panel title, metrics keys drawn in it, whether a trend line is drawn), per panel."""
    named = {metric.plot for metric in RECORD if metric.plot is not None}
    if named != TRENDS.keys():
        raise ValueError(
            f"services/metrics.py plots keys in panels {sorted(named)}, curves.png has "
            f"{sorted(TRENDS)}: each panel draws at least one declared key, and only those"
        )
    return tuple(
        (title, tuple(metric.key for metric in RECORD if metric.plot == title), trend)
        for title, trend in TRENDS.items()
    )


PANELS = _panels()
PLOTTED_KEYS = ("step", *(key for _, keys, _ in PANELS for key in keys))


def moving_average(values: Sequence[float], window: int = 0) -> list[float]:
    """Trailing mean over `window` points (default: a fifteenth of the series, at least 1)."""
    window = window or max(1, len(values) // 15)
    out, total = [], 0.0
    for i, value in enumerate(values):
        total += value
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def plot_curves(records: Sequence[MetricsRecord], path: Path, title: str = "") -> Path:
    """Draw reward, entropy, clip fraction and staleness against the learner step into `path`."""
    # Imported here, with a file-only backend: plotting is the only thing that needs matplotlib,
    # and a run on a machine without a display must not try to open one.
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    # A panel whose keys no record holds (tools, in a run without them) is left out.
    panels = [p for p in PANELS if any(r.get(key) is not None for r in records for key in p[1])]
    rows = max(1, math.ceil(len(panels) / 2))
    figure, axes = plt.subplots(rows, 2, figsize=(10, 3.5 * rows), sharex=True, squeeze=False)
    for axis in axes.flat[len(panels) :]:
        axis.set_visible(False)
    for axis, (panel, keys, smooth) in zip(axes.flat, panels, strict=False):
        for key in keys:
            points = [(r["step"], r[key]) for r in records if r.get(key) is not None]
            if not points:
                continue
            steps, values = zip(*points, strict=True)
            if not smooth:
                axis.plot(steps, values, label=key)
                continue
            (line,) = axis.plot(steps, values, linewidth=0.8, alpha=0.35)
            # Batch means are noisy; the trend is what a person looks for.
            axis.plot(steps, moving_average(values), color=line.get_color(), label=key)
        axis.set_title(panel)
        axis.grid(alpha=0.3)
        if len(keys) > 1 and axis.get_legend_handles_labels()[0]:
            axis.legend(fontsize=8)
    # The lowest drawn panel of each column carries the step axis (an odd count leaves the
    # bottom-right cell empty, and shared axes show tick labels on the bottom row only).
    for column in range(2):
        drawn = [axis for axis in axes[:, column] if axis.get_visible()]
        if drawn:
            drawn[-1].xaxis.set_tick_params(labelbottom=True)
            drawn[-1].set_xlabel("learner step")
    figure.suptitle(title)
    figure.tight_layout()
    # Into place in one rename: whoever reads the file (the dashboard, a person) never sees half
    # a PNG, and a drawing that is killed leaves the previous one.
    partial = path.with_name(f".{path.name}.partial")
    figure.savefig(partial, dpi=110, format="png")
    plt.close(figure)
    os.replace(partial, path)
    return path


def draw_run_curves(out_dir: Path, title: str = "") -> Path | None:
    """Redraw `out_dir`'s curves.png from its metrics file; None while it has no records."""
    records = read_metrics(out_dir, PLOTTED_KEYS)
    return plot_curves(records, out_dir / CURVES_FILE, title) if records else None


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m services.pipeline.plots RUN_DIR [--title T]`: what `CurveDrawer` runs."""
    parser = argparse.ArgumentParser(description=draw_run_curves.__doc__)
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--title", default="")
    args = parser.parse_args(argv)
    draw_run_curves(args.run_dir, args.title)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
