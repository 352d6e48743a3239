"""The cells of the stability study: estimator x staleness setting, and the run spec of each."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from services.spec import RunSpec


# Methods and staleness settings are module constants, compared and hashed by identity (their
# dict fields are not hashable).
@dataclass(frozen=True, eq=False)
class Method:
    """An estimator configuration with the reference its ratios are taken against."""

    key: str
    label: str
    estimator: dict[str, Any]
    reference: str = "behaviour"
    off_policy: dict[str, Any] = field(default_factory=dict)
    loss_agg_mode: str | None = None  # None: the estimator's default


@dataclass(frozen=True, eq=False)
class Staleness:
    """How stale the batches are: the pipeline settings of one column of the grid."""

    key: str
    label: str
    pipeline: dict[str, Any]


@dataclass(frozen=True)
class Cell:
    method: Method
    staleness: Staleness
    # baseline: the paper's estimators; reference: behaviour vs proximal ratios; ablation: KPO
    # with another loss aggregation.
    group: str

    @property
    def key(self) -> str:
        return f"{self.method.key}__{self.staleness.key}"


BASELINES = (
    Method("grpo", "GRPO (token)", {"name": "token"}),
    Method("gspo", "GSPO (sequence)", {"name": "sequence"}),
    Method("gmpo", "GMPO (geometric)", {"name": "geometric"}),
    Method("kpo", "KPO clipped", {"name": "kalman"}),
    Method("kpo-unclipped", "KPO unclipped", {"name": "kalman", "clipped": False}),
    Method("ctpo", "CTPO (cumulative)", {"name": "cumulative"}),
)
# Decoupled PPO (AReaL): ratios against the proximal policy, stale samples weighted by
# pi_prox / pi_behaviour truncated at 2.
PROXIMAL = Method(
    "kpo-proximal",
    "KPO clipped, proximal + decoupled weights",
    {"name": "kalman"},
    reference="proximal",
    off_policy={"tis_cap": 2.0},
)

# KPO's default aggregation (seq-mean-token-mean, the official code's) weights each token by
# 1 / its response's length; token-mean does not.
TOKEN_MEAN = Method(
    "kpo-token-mean", "KPO clipped, token-mean", {"name": "kalman"}, loss_agg_mode="token-mean"
)

SYNC = Staleness("sync", "synchronous", {"mode": "sync", "max_staleness": 0})
STALE_2 = Staleness(
    "stale-2", "max_staleness 2", {"mode": "async", "max_staleness": 2, "lead_batches": 2}
)
STALE_8 = Staleness(
    "stale-8", "max_staleness 8", {"mode": "async", "max_staleness": 8, "lead_batches": 8}
)
STALENESS = (SYNC, STALE_2, STALE_8)


def grid(full: bool) -> list[Cell]:
    """Every cell: all baselines at every staleness; the proximal reference at max_staleness 8
    (the reduced grid) or at 2 and 8 (`full`); the aggregation ablation synchronous and at 8
    (or at every staleness)."""
    cells = [Cell(m, s, "baseline") for s in STALENESS for m in BASELINES]
    stale = (STALE_2, STALE_8) if full else (STALE_8,)
    cells += [Cell(PROXIMAL, s, "reference") for s in stale]
    ablated = STALENESS if full else (SYNC, STALE_8)
    cells += [Cell(TOKEN_MEAN, s, "ablation") for s in ablated]
    return cells


def cell_spec(base: RunSpec, cell: Cell, seed: int) -> RunSpec:
    """`base` with the cell's estimator, reference and pipeline settings, and `seed`."""
    data = base.model_dump(mode="json")
    data["name"] = f"{cell.key}-s{seed}"[:63]
    data["seed"] = seed
    data["algorithm"]["estimator"] = dict(cell.method.estimator)
    data["algorithm"]["reference"] = cell.method.reference
    data["algorithm"]["off_policy"] = dict(cell.method.off_policy)
    data["algorithm"]["loss_agg_mode"] = cell.method.loss_agg_mode
    pipeline = data["pipeline"]
    pipeline.update(cell.staleness.pipeline)
    # Let the staleness setting size the buffer (the base spec resolved it for its own).
    pipeline["buffer_groups"] = 0
    if pipeline["mode"] == "sync":
        pipeline["lead_batches"] = 0
    return RunSpec.model_validate(data)
