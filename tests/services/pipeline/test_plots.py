"""curves.png and its trend line."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.metrics import Kind, MetricKey, Source
from services.pipeline import plots
from services.pipeline.outputs import RunDirectory
from services.pipeline.plots import PLOTTED_KEYS, moving_average, plot_curves


def test_moving_average_is_a_trailing_mean() -> None:
    # window 2: [1], [1, 2], [2, 3], [3, 4]
    assert moving_average([1.0, 2.0, 3.0, 4.0], 2) == [1.0, 1.5, 2.5, 3.5]
    assert moving_average([5.0] * 30) == [5.0] * 30


def test_curves_are_drawn_even_with_gaps(tmp_path: Path) -> None:
    keys = [key for key in PLOTTED_KEYS if key != "step"]
    records = [{"step": s, **dict.fromkeys(keys, s / 10)} for s in range(1, 31)]
    records[3]["entropy"] = None  # a NaN written as null
    path = plot_curves(records, tmp_path / "curves.png", "t")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_curves_are_drawn_from_the_plotted_keys_alone(tmp_path: Path) -> None:
    run_dir = RunDirectory(tmp_path)
    for step in range(1, 6):
        run_dir.on_metrics({"step": step, "reward_mean": step / 10, "grad_norm": 1.0, "lr": 0.1})
    records = run_dir.read_metrics(PLOTTED_KEYS)
    assert records == [{"step": s, "reward_mean": s / 10} for s in range(1, 6)]
    assert run_dir.read_metrics()[0].keys() == {"step", "reward_mean", "grad_norm", "lr"}
    path = plot_curves(records, tmp_path / "curves.png")
    assert path.stat().st_size > 10_000


def test_the_panels_draw_the_keys_declared_for_them(monkeypatch: pytest.MonkeyPatch) -> None:
    # services/metrics.py: reward_mean and the held-out evaluation's -> "reward", staleness_mean
    # and _max -> "staleness ...".
    panels = {title: keys for title, keys, _ in plots.PANELS}
    assert panels["reward"] == ("reward_mean", "eval_accuracy_avg_at_k", "eval_pass_at_k")
    assert panels["staleness (versions)"] == ("staleness_mean", "staleness_max")
    stray = MetricKey("lr", Kind.RECORD, "", "Learning rate.", Source.LEARNER, plot="lr")
    monkeypatch.setattr(plots, "RECORD", (*plots.RECORD, stray))
    with pytest.raises(ValueError, match="each panel draws at least one declared key"):
        plots._panels()  # a key for a panel curves.png does not have


def test_the_tools_panel_is_drawn_only_for_a_run_with_tools(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import matplotlib.pyplot as plt

    drawn: list[int] = []
    subplots = plt.subplots

    def counting(rows: int, cols: int, **kwargs: object) -> object:
        drawn.append(rows * cols)
        return subplots(rows, cols, **kwargs)

    monkeypatch.setattr(plt, "subplots", counting)
    plain = [{"step": s, "reward_mean": 0.1, "entropy": 1.0} for s in range(1, 6)]
    plot_curves(plain, tmp_path / "plain.png")
    tools = [{**r, "tool_calls_per_response": 0.5} for r in plain]
    plot_curves(tools, tmp_path / "tools.png")
    assert drawn == [2, 4]  # reward and entropy; then the tools panel beside them
