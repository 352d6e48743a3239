"""The study's figures (PNG): training curves, held-out accuracy, ratio dynamics, filter error."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only: the study runs on machines without a display
import matplotlib.pyplot as plt
import numpy as np
from torch import Tensor

from services.pipeline.plots import moving_average
from stability_study.filter_accuracy import FilterComparison
from stability_study.grid import Cell, Setting
from stability_study.runner import RunResult
from stability_study.summary import curve

CURVE_PANELS = (
    ("reward_mean", "reward (moving average)", True, False),
    ("entropy", "entropy", True, False),
    ("clip_fraction", "clip fraction", True, False),
    ("approx_kl", "KL to the behaviour policy (k3)", True, True),
    ("kalman_shrinkage_mean", "KPO shrinkage W", False, False),
)


def _save(figure: Any, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.tight_layout()
    figure.savefig(path, dpi=110, bbox_inches="tight")  # legends placed beside the panels
    plt.close(figure)
    return path


# Floor of log-scale panels: k3 KL estimates can come out at -1e-9 from rounding.
LOG_FLOOR = 1e-6


def _band(
    axis: Any, results: Sequence[RunResult], key: str, smooth: bool, log_scale: bool, label: str
) -> None:
    """The mean over seeds as a line, the seeds' range (min to max) as a band."""
    steps, mean, low, high = curve(results, key)
    if steps.size == 0:
        return
    if smooth:
        mean, low, high = (np.array(moving_average(list(v), 5)) for v in (mean, low, high))
    if log_scale:
        mean, low, high = (np.maximum(v, LOG_FLOOR) for v in (mean, low, high))
    (line,) = axis.plot(steps, mean, label=label, linewidth=1.3)
    axis.fill_between(steps, low, high, color=line.get_color(), alpha=0.12)


def plot_training_curves(
    results: Mapping[Cell, Sequence[RunResult]], columns: Sequence[Setting], path: Path
) -> Path:
    """Rows: reward, entropy, clip fraction, KL, shrinkage; columns: settings; a line per
    method (mean over seeds; band: the seeds' range)."""
    figure, axes = plt.subplots(
        len(CURVE_PANELS), len(columns), figsize=(5 * len(columns), 13), sharex=True
    )
    axes = np.atleast_2d(axes).reshape(len(CURVE_PANELS), len(columns))
    for col, setting in enumerate(columns):
        cells = [c for c in results if c.setting is setting]
        for row, (key, title, smooth, log_scale) in enumerate(CURVE_PANELS):
            axis = axes[row, col]
            for cell in cells:
                _band(axis, results[cell], key, smooth, log_scale, cell.method.label)
            axis.set_title(f"{title}: {setting.label}", fontsize=9)
            if log_scale:
                axis.set_yscale("log")
            axis.grid(alpha=0.3)
        axes[-1, col].set_xlabel("learner step")
    axes[0, 0].legend(fontsize=7)
    return _save(figure, path)


def plot_accuracy(
    results: Mapping[Cell, Sequence[RunResult]], columns: Sequence[Setting], path: Path
) -> Path:
    """Held-out accuracy by learner step, mean +- standard deviation over seeds; one panel per
    setting."""
    # Wide enough for the legend beside the panels: inside, it would cover the collapsed arms.
    figure, axes = plt.subplots(1, len(columns), figsize=(5 * len(columns) + 3, 4), sharey=True)
    for axis, setting in zip(np.atleast_1d(axes), columns, strict=True):
        for cell, runs in results.items():
            if cell.setting is not setting:
                continue
            steps = sorted(set.intersection(*(set(r.accuracy) for r in runs)))
            values = np.array([[r.accuracy[s] for s in steps] for r in runs])
            std = values.std(0, ddof=1) if len(runs) > 1 else np.zeros(len(steps))
            axis.errorbar(steps, values.mean(0), yerr=std, label=cell.method.label, capsize=3)
        axis.set_title(f"held-out accuracy: {setting.label}", fontsize=9)
        axis.set_xlabel("learner step")
        axis.grid(alpha=0.3)
    np.atleast_1d(axes)[-1].legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.02, 1.0))
    return _save(figure, path)


def plot_ratio_dynamics(
    examples: Mapping[str, tuple[Tensor, dict[str, Tensor]]],
    windows: Mapping[str, Mapping[str, Mapping[str, Any]]],
    path: Path,
) -> Path:
    """Top: one recorded response's raw and filtered ratios per setting. Bottom: window-wise
    off-policy frequency (up + down) of raw vs filtered ratios."""
    names = list(examples)
    figure, axes = plt.subplots(2, len(names), figsize=(5 * len(names), 7))
    axes = np.atleast_2d(axes).reshape(2, len(names))
    for col, name in enumerate(names):
        raw, filtered = examples[name]
        axis = axes[0, col]
        axis.plot(raw.exp().numpy(), linewidth=0.8, alpha=0.6, label="raw")
        for label, values in filtered.items():
            axis.plot(values.exp().numpy(), linewidth=1.4, label=label)
        axis.set_title(f"token ratios of one response: {name}", fontsize=9)
        axis.set_xlabel("token")
        axis.grid(alpha=0.3)
        axis = axes[1, col]
        for label, table in windows[name].items():
            up = np.array(table["window_frequency_up"])
            down = np.array(table["window_frequency_down"])
            if up.size:
                axis.plot(np.arange(1, up.size + 1), up + down, marker="o", label=label)
        axis.set_title(f"off-policy tokens per 50-token window: {name}", fontsize=9)
        axis.set_xlabel("window")
        axis.xaxis.get_major_locator().set_params(integer=True)
        axis.set_ylim(-0.02, 1.02)
        axis.grid(alpha=0.3)
    axes[0, 0].legend(fontsize=7)
    axes[1, 0].legend(fontsize=7)
    return _save(figure, path)


def plot_filter_accuracy(rows: Sequence[FilterComparison], path: Path) -> Path:
    """Max error against the float64 recursion, by sequence length."""
    figure, axis = plt.subplots(figsize=(6, 4))
    for q in sorted({r.q for r in rows}):
        chosen = [r for r in rows if r.q == q]
        lengths = [r.length for r in chosen]
        axis.plot(lengths, [r.parallel_error for r in chosen], marker="o", label=f"ours, q={q:g}")
        axis.plot(
            lengths,
            [r.closed_form_error for r in chosen],
            marker="x",
            linestyle="--",
            label=f"official closed form, q={q:g}",
        )
    axis.axhline(1e-6, color="grey", linewidth=0.8, linestyle=":")
    axis.set_xscale("log", base=2)
    axis.set_yscale("log")
    axis.set_xlabel("tokens in the sequence")
    axis.set_ylabel("max |x - x_float64 recursion|")
    axis.grid(alpha=0.3)
    axis.legend(fontsize=7)
    return _save(figure, path)
