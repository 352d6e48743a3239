"""The study's GMPO arm, per-arm ratio diagnostics, and the in-flight phase's parts."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest
import torch

from kpo_core.config import KalmanEstimator
from services.pipeline.specs import load_run_spec
from stability_study import dynamics, report
from stability_study.grid import (
    ARMS,
    IN_FLIGHT,
    IN_FLIGHT_ARMS,
    SWITCH_BASELINES,
    cell_spec,
    in_flight_cells,
)
from stability_study.runner import RunResult
from stability_study.summary import summarize
from tests.benchmarks.test_study import STUDY_CONFIG, fake_result, run_tiny_study


def test_the_arms_include_gmpo_and_the_in_flight_phase_its_switch_arms() -> None:
    assert "gmpo" in [m.key for m in ARMS]
    assert {m.estimator["name"] for m in ARMS} >= {"geometric", "kalman", "token"}
    base = load_run_spec(STUDY_CONFIG)
    modes = []
    for cell in in_flight_cells():
        spec = cell_spec(base, cell, seed=3)
        assert spec.pipeline.in_flight_updates and spec.pipeline.weight_transport == "collective"
        estimator = spec.algorithm.estimator
        assert isinstance(estimator, KalmanEstimator) and estimator.reference_length == "auto"
        modes.append(estimator.version_switch)
        # Every arm is valid once `auto` is resolved (reset's prior check reads q then).
        spec.algorithm.with_response_length(spec.generation.max_new_tokens)
    assert sorted(set(modes)) == ["inflate", "off", "reset"]
    keys = {m.key for m in IN_FLIGHT_ARMS}
    assert set(SWITCH_BASELINES) <= keys and set(SWITCH_BASELINES.values()) <= keys
    assert all(c.setting is IN_FLIGHT for c in in_flight_cells())


def switching_sample(jump: float = 0.5) -> dynamics.RatioSample:
    """Rows of 64 tokens whose log-ratio level jumps where the version switches (token 20)."""
    generator = torch.Generator().manual_seed(0)
    z = torch.randn(8, 64, generator=generator, dtype=torch.float64) * 0.05
    versions = torch.zeros(8, 64, dtype=torch.long)
    versions[:, 20:] = 1
    z[:, 20:] += jump
    mask = torch.ones(8, 64, dtype=torch.bool)
    mask[1, 50:] = False
    return dynamics.RatioSample(z.float(), mask, versions)


def test_tracking_error_by_hand_on_one_switch() -> None:
    # One row, one switch at token 2, q = 0 and a diffuse prior: x is the running mean (off),
    # or restarts as the new segment's running mean (reset).
    z = torch.tensor([[0.0, 0.2, 1.0, 1.4, 1.2]])
    versions = torch.tensor([[0, 0, 1, 1, 1]])
    sample = dynamics.RatioSample(z, torch.ones(1, 5, dtype=torch.bool), versions)
    level = (1.0 + 1.4 + 1.2) / 3
    off = KalmanEstimator(q=0.0, p0="diffuse", reference_length=None)
    running = [sum([0.0, 0.2, 1.0, 1.4, 1.2][: t + 1]) / (t + 1) for t in range(5)]
    expected_off = sum(abs(running[t] - level) for t in (2, 3, 4)) / 3
    result = dynamics.switch_tracking_error(sample, off)
    assert result.switches == 1
    assert result.error == pytest.approx(expected_off, abs=1e-5)
    reset = off.model_copy(update={"version_switch": "reset"})
    restarted = [1.0, 1.2, 1.2]
    expected_reset = sum(abs(v - level) for v in restarted) / 3
    assert dynamics.switch_tracking_error(sample, reset).error == pytest.approx(
        expected_reset, abs=1e-5
    )
    # The horizon cuts the tokens counted after the switch.
    short = dynamics.switch_tracking_error(sample, off, horizon=1)
    assert short.error == pytest.approx(abs(running[2] - level), abs=1e-5)


def test_resetting_tracks_a_jump_closer_than_the_plain_filter() -> None:
    sample = switching_sample()
    off = KalmanEstimator(p0="diffuse", q=1e-3, reference_length=None)
    reset = off.model_copy(update={"version_switch": "reset"})
    plain = KalmanEstimator(q=1e-3, reference_length=None)
    inflate = plain.model_copy(update={"version_switch": "inflate", "switch_q": 1.0})
    errors = {
        name: dynamics.switch_tracking_error(sample, cfg)
        for name, cfg in [("off", off), ("reset", reset), ("plain", plain), ("inflate", inflate)]
    }
    assert all(e.switches == 8 for e in errors.values())
    assert errors["reset"].error < 0.5 * errors["off"].error
    assert errors["inflate"].error < 0.5 * errors["plain"].error
    # One version throughout: nothing to measure; an unresolved length is refused.
    single = dynamics.RatioSample(sample.log_ratio, sample.mask, torch.zeros_like(sample.versions))
    none = dynamics.switch_tracking_error(single, off)
    assert none.switches == 0 and math.isnan(none.error)
    with pytest.raises(ValueError, match="resolve reference_length"):
        dynamics.switch_tracking_error(sample, KalmanEstimator())


def test_ratio_files_carry_token_versions_into_the_sample(tmp_path: Path) -> None:
    sample = switching_sample()
    directory = tmp_path / "run" / "ratios"
    directory.mkdir(parents=True)
    torch.save(
        {
            "log_ratio": sample.log_ratio,
            "mask": sample.mask,
            "token_versions": sample.versions,
        },
        directory / "step-000001.pt",
    )
    loaded = dynamics.load_ratios([tmp_path / "run"])
    assert loaded.versions is not None and torch.equal(loaded.versions, sample.versions)


def with_dynamics(seed: int, raw_switch: float, filtered_switch: float) -> RunResult:
    result = fake_result([0.2, 0.3], seed=seed)
    for record in result.records:
        record.update(
            {
                "raw_switch_frequency": raw_switch,
                "filtered_switch_frequency": filtered_switch,
                "raw_low_frequency_ratio": 0.1,
                "filtered_low_frequency_ratio": 0.9,
                "raw_run_length_up": 1.5,
                "filtered_run_length_up": 100.0,
                "raw_run_length_down": 1.5,
                "filtered_run_length_down": 90.0,
                "raw_run_length_on": 3.0,
                "filtered_run_length_on": 30.0,
            }
        )
    return result


def test_the_diagnostics_table_gives_each_arm_beside_the_papers_figures() -> None:
    summary = summarize([with_dynamics(0, 0.4, 0.02), with_dynamics(1, 0.5, 0.04)], 0.1)
    assert summary.dynamics["raw_switch_frequency"].mean == pytest.approx(0.45)
    assert summary.dynamics["filtered_switch_frequency"].mean == pytest.approx(0.03)
    lines = report.arm_dynamics_table([summary])
    text = "\n".join(lines)
    assert "0.45 -> 0.03" in text and "0.1 -> 0.9" in text
    assert "0.43 -> 0.01" in text and "0.12 -> 0.98" in text  # the paper's row


def test_the_in_flight_table_pairs_each_switch_arm_with_its_off_twin() -> None:
    off_cell, inflate_cell = in_flight_cells()[0], in_flight_cells()[1]
    off = [fake_result([0.2, 0.3], seed=s) for s in range(6)]
    inflate = [fake_result([0.2, 0.3 + 0.01 * s], seed=s) for s in range(6)]
    summaries = {
        off_cell: summarize(off, 0.1),
        inflate_cell: summarize(inflate, 0.1),
    }
    summaries = {cell: dataclasses.replace(s, cell=cell) for cell, s in summaries.items()}
    tracking = {
        off_cell: dynamics.TrackingError(0.3, 12),
        inflate_cell: dynamics.TrackingError(0.1, 12),
    }
    text = "\n".join(report.in_flight_table(summaries, tracking))
    # Paired gains minus the off twin's: 0.00 .. 0.05, mean 0.025.
    assert "+0.025 [" in text
    assert "0.300 (12 switches)" in text and "0.100 (12 switches)" in text


@pytest.mark.timeout(900)
def test_the_in_flight_phase_runs_and_reports_its_switch_arms(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    only = "^kpo-switch-(off|inflate)__in-flight$"
    out, docs, _ = run_tiny_study(tmp_path, monkeypatch, "in-flight", only, ratios_every=1)
    for arm in ("kpo-switch-off", "kpo-switch-inflate"):
        run = out / "runs" / f"{arm}__in-flight" / "seed-0"
        ratios = sorted((run / "ratios").glob("step-*.pt"))
        assert len(ratios) == 4
        record = torch.load(ratios[-1], weights_only=True)
        assert record["token_versions"].shape == record["mask"].shape
    document = (docs / "results.md").read_text()
    assert "### In-flight weight updates: `version_switch` under" in document
    assert "| KPO length-matched, version_switch inflate (switch_q 1) |" in document
    assert "minus the switch-off twin's, paired" in document
    assert "| paper (raw -> KPO) | 0.43 -> 0.01 | 0.12 -> 0.98 |" in document
