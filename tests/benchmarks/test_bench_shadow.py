"""The shadow estimators' benchmark at a tiny size: it measures both settings and reports the
shadowed step against the baseline of the same run."""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import bench_shadow

from services.metrics import SHADOW_KEYS


def test_a_tiny_run_reports_both_settings_and_their_ratios(tmp_path: Path) -> None:
    out = tmp_path / "shadow.json"
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        flags = ["--no-wide", "--steps", "2", "--tiny-rows", "2", "--tiny-tokens", "16"]
        results = bench_shadow.main([*flags, "--json", str(out)])
    assert json.loads(out.read_text()) == results
    [tiny] = results
    assert tiny["case"]["name"] == "tiny-arith" and tiny["case"]["tokens"] == 16
    timing = tiny["timing"]
    # Two timing processes (either learner built first), 2 steps each.
    assert all(len(timing["seconds"][label]) == 4 for label in ("none", "four"))
    # The shadowed learner wrote every declared key of its four estimators.
    four = [key for key in SHADOW_KEYS if key.split("_")[1] in bench_shadow.SHADOWS]
    assert timing["shadow_keys"] == len(four)
    assert timing["shadow_loss_seconds"] > 0 and tiny["shadow_work_seconds"] > 0
    assert timing["median_ratio"] > 0 and tiny["peak_rss_ratio"] > 0
    for label in ("none", "four"):
        assert tiny["memory"][label]["peak_rss_bytes"] > 0
    report = printed.getvalue()
    assert "token+sequence+geometric+cumulative" in report and "x base" in report
