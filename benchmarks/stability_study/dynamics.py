"""Ratio dynamics on recorded log-ratios: the paper's diagnostics, raw vs Kalman-filtered.

The learner saves each recorded step's token log-ratios (`learner.record_ratios_every`). Here
they are pooled per staleness setting and measured as they are (raw ratios exp(z)) and after
the filter at several Q/R, with the paper's token-type band (up above 1 + 4e-4, down below
1 - 3e-4) and 50-token windows (kpo_core.diagnostics).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from kpo_core.config import KalmanEstimator
from kpo_core.diagnostics import DIAGNOSTIC_SCALARS, ratio_diagnostics
from kpo_core.kalman import kalman_filter, switch_process_noise, version_switches
from services.pipeline.driver import RATIO_DIR

Q_OVER_R = (1e-6, 1e-4, 1e-2)
SCALARS = DIAGNOSTIC_SCALARS


@dataclass(frozen=True)
class RatioSample:
    """Recorded log-ratios [N, T] (0 off the mask) and the mask, pooled over files."""

    log_ratio: Tensor
    mask: Tensor
    # [N, T] the policy version that sampled each token (files written before the learner
    # recorded them: none, as if every response had one version).
    versions: Tensor | None = None

    @property
    def responses(self) -> int:
        return int(self.mask.shape[0])

    @property
    def tokens(self) -> int:
        return int(self.mask.sum())


def load_ratios(run_dirs: Sequence[Path]) -> RatioSample:
    """Every ratio file of the runs, right-padded to one width."""
    parts = []
    for run_dir in run_dirs:
        for path in sorted((run_dir / RATIO_DIR).glob("step-*.pt")):
            parts.append(torch.load(path, weights_only=True))
    if not parts:
        raise ValueError(f"no ratio files under {[str(d) for d in run_dirs]}")
    width = max(p["mask"].shape[1] for p in parts)

    def padded(t: Tensor) -> Tensor:
        return torch.nn.functional.pad(t, (0, width - t.shape[1]))

    log_ratio = torch.cat([padded(p["log_ratio"].float()) for p in parts])
    mask = torch.cat([padded(p["mask"].bool()) for p in parts])
    versions = None
    if all("token_versions" in p for p in parts):
        versions = torch.cat([padded(p["token_versions"].long()) for p in parts])
    return RatioSample(torch.where(mask, log_ratio, 0.0), mask, versions)


SWITCH_HORIZON = 16


@dataclass(frozen=True)
class TrackingError:
    """How closely the filter follows the log-ratio's new level after a version switch."""

    error: float  # mean over switches of the per-switch mean |x_t - zbar_seg| (nan: none)
    switches: int


def switch_tracking_error(
    sample: RatioSample, estimator: KalmanEstimator, horizon: int = SWITCH_HORIZON
) -> TrackingError:
    """The filter's tracking error after a switch (SPEC.md, `version_switch`): for each switch,
    the mean of |x_t - zbar_seg| over the switch token and the model tokens after it in its
    segment, at most `horizon` of them, where zbar_seg is the mean raw log-ratio of the
    segment (the tokens of one version); then the mean over switches.

    x is `estimator`'s filter (reference length resolved) with its `version_switch`, on the
    recorded log-ratios and versions.
    """
    if sample.versions is None:
        return TrackingError(math.nan, 0)
    if estimator.reference_length == "auto":
        raise ValueError("resolve reference_length (with_response_length) before filtering")
    z, mask, versions = sample.log_ratio.double(), sample.mask, sample.versions
    switches = version_switches(versions, mask)
    q, r, p0 = estimator.effective_q, estimator.r, estimator.effective_p0
    noise = switch_process_noise(
        switches, mask, q, r, p0, estimator.version_switch, estimator.switch_q
    )
    x = kalman_filter(z, mask, noise, r, p0, estimator.x0)
    # Segment s of a row: its tokens after s switches; a (row, segment) pair is one index.
    segment = switches.long().cumsum(-1)
    width = int(segment.max()) + 1
    flat = (torch.arange(z.shape[0])[:, None] * width + segment)[mask]
    totals = torch.zeros(z.shape[0] * width, dtype=torch.float64)
    totals.index_add_(0, flat, z[mask])
    counts = torch.zeros_like(totals).index_add_(0, flat, torch.ones_like(z[mask]))
    level = (totals / counts.clamp_min(1))[flat]
    # Position of each valid token within its segment, from 1 at the segment's first token.
    count = mask.long().cumsum(-1)
    start = torch.where(switches, count, 0).cummax(-1).values
    position = (count - start + 1)[mask]
    after = (segment[mask] > 0) & (position <= horizon)
    if not bool(after.any()):
        return TrackingError(math.nan, 0)
    error = (x[mask] - level).abs()
    per_switch = torch.zeros_like(totals).index_add_(0, flat[after], error[after])
    tokens = torch.zeros_like(totals).index_add_(0, flat[after], torch.ones_like(error[after]))
    seen = tokens > 0
    return TrackingError(float((per_switch[seen] / tokens[seen]).mean()), int(seen.sum()))


def diagnostics_table(sample: RatioSample) -> dict[str, dict[str, float | list[float]]]:
    """{"raw": diagnostics, "q/r=1e-06": ..., ...} of one pooled sample."""
    rows: dict[str, dict[str, float | list[float]]] = {}
    rows["raw"] = ratio_diagnostics(sample.log_ratio.exp(), sample.mask)
    for q in Q_OVER_R:
        filtered = kalman_filter(sample.log_ratio, sample.mask, q, 1.0)
        rows[f"q/r={q:g}"] = ratio_diagnostics(filtered.exp(), sample.mask)
    return rows


def example_sequence(sample: RatioSample, min_tokens: int = 60) -> tuple[Tensor, dict[str, Tensor]]:
    """The raw log-ratios of the response with the largest variance among those of at least
    `min_tokens` tokens, with its filtered versions: what a reader looks at in the plot."""
    lengths = sample.mask.sum(-1)
    candidates = (lengths >= min(min_tokens, int(lengths.max()))).nonzero().flatten()
    values = sample.log_ratio[candidates]
    counts = lengths[candidates].clamp_min(1)
    mean = values.sum(-1) / counts
    variance = ((values - mean[:, None]) ** 2 * sample.mask[candidates]).sum(-1) / counts
    row = int(candidates[variance.argmax()])
    n = int(lengths[row])
    valid = sample.mask[row]
    raw = sample.log_ratio[row][valid][:n]
    filtered = {
        f"q/r={q:g}": kalman_filter(raw[None], torch.ones(1, n, dtype=torch.bool), q, 1.0)[0]
        for q in Q_OVER_R
    }
    return raw, filtered
