"""Ratio dynamics on recorded log-ratios: the paper's diagnostics, raw vs Kalman-filtered.

The learner saves each recorded step's token log-ratios (`learner.record_ratios_every`). Here
they are pooled per staleness setting and measured as they are (raw ratios exp(z)) and after
the filter at several Q/R, with the paper's token-type band (up above 1 + 4e-4, down below
1 - 3e-4) and 50-token windows (kpo_core.diagnostics).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from kpo_core.diagnostics import DIAGNOSTIC_SCALARS, ratio_diagnostics
from kpo_core.kalman import kalman_filter
from services.pipeline.driver import RATIO_DIR

Q_OVER_R = (1e-6, 1e-4, 1e-2)
SCALARS = DIAGNOSTIC_SCALARS


@dataclass(frozen=True)
class RatioSample:
    """Recorded log-ratios [N, T] (0 off the mask) and the mask, pooled over files."""

    log_ratio: Tensor
    mask: Tensor

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
    return RatioSample(torch.where(mask, log_ratio, 0.0), mask)


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
