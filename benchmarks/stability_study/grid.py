"""The cells of the stability study: estimator x setting, in three phases, and each run's spec.

- pilot: GRPO under each stress setting, to find one where GRPO collapses;
- main: every arm at the stress setting the pilot picked (`stress_setting`);
- gentle: every arm at a gentle synchronous setting, to show that each one learns;
- in-flight: KPO length-matched with each `version_switch`, with in-flight weight updates over
  the collective transport, where responses are sampled by two or more policy versions;
- guard: the arms that collapse under the stress (no trust region) and GRPO, with and without
  the stability guard rolling back; and KPO's staleness bound fixed at 1, 4, 8 or adaptive.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from services.spec import RunSpec


# Methods and settings are module constants, compared and hashed by identity (their dict fields
# are not hashable).
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
class Setting:
    """The training conditions of one column of the grid: overrides of the base spec's
    sections (`pipeline`, `learner`), field by field."""

    key: str
    label: str
    overrides: dict[str, dict[str, Any]]

    @property
    def max_staleness(self) -> int:
        return int(self.overrides.get("pipeline", {}).get("max_staleness", 0))


@dataclass(frozen=True)
class Cell:
    method: Method
    setting: Setting

    @property
    def key(self) -> str:
        return f"{self.method.key}__{self.setting.key}"


# The paper's constants, pinned so that the arm keeps them whatever the estimator's defaults.
_KPO_PAPER = {"name": "kalman", "q": 1e-6, "r": 1.0, "p0": 0.0, "reference_length": None}
_KPO_DIFFUSE = {**_KPO_PAPER, "p0": "diffuse", "clip_mode": "posterior"}
GRPO = Method("grpo", "GRPO (token)", {"name": "token"})
ARMS = (
    GRPO,
    Method("gspo", "GSPO (sequence)", {"name": "sequence"}),
    Method("ctpo", "CTPO (cumulative)", {"name": "cumulative"}),
    Method("gmpo", "GMPO (geometric)", {"name": "geometric"}),
    Method("kpo-paper", "KPO, paper constants", _KPO_PAPER),
    Method(
        "kpo-matched",
        "KPO, length-matched",
        {**_KPO_PAPER, "reference_length": "auto"},
    ),
    Method(
        "kpo-matched-unclipped",
        "KPO, length-matched, unclipped",
        {**_KPO_PAPER, "reference_length": "auto", "clipped": False},
    ),
    Method("kpo-diffuse", "KPO, diffuse prior, posterior-sd clip", _KPO_DIFFUSE),
    # q = 0 with P0 = 0: every gain is 0, the filtered log-ratio stays at 0 and the ratio is 1:
    # REINFORCE on the (stale) batch, no importance correction, no trust region.
    Method("kpo-q0", "control: KPO with q = 0 (REINFORCE)", {**_KPO_PAPER, "q": 0.0}),
)

_STALE_8 = {"mode": "async", "max_staleness": 8, "lead_batches": 8}
STRESSES = (
    Setting(
        "lr3e-4-stale-8",
        "lr 3e-4, max_staleness 8",
        {"learner": {"lr": 3e-4}, "pipeline": _STALE_8},
    ),
    Setting(
        "stale-16",
        "lr 1.5e-4, max_staleness 16",
        {"pipeline": {"mode": "async", "max_staleness": 16, "lead_batches": 16}},
    ),
    Setting(
        "mb8-stale-8",
        "lr 1.5e-4, 8 minibatches, max_staleness 8",
        {"learner": {"minibatches": 8}, "pipeline": _STALE_8},
    ),
)
GENTLE = Setting(
    "gentle-sync",
    "lr 5e-5, synchronous",
    {"learner": {"lr": 5e-5}, "pipeline": {"mode": "sync", "max_staleness": 0}},
)
# New weights reach generation between decoding steps: responses in flight go on under the new
# version, so one response is sampled by several (SPEC.md, `version_switch`).
IN_FLIGHT = Setting(
    "in-flight",
    "lr 1.5e-4, max_staleness 2, in-flight updates over the collective transport",
    {
        "pipeline": {
            "mode": "async",
            "max_staleness": 2,
            "weight_transport": "collective",
            "in_flight_updates": True,
        }
    },
)
_KPO_MATCHED = {**_KPO_PAPER, "reference_length": "auto"}
SWITCH_OFF = Method("kpo-switch-off", "KPO length-matched, version_switch off", _KPO_MATCHED)
# `reset` restarts the covariance at P0, which must be at least the steady state: the diffuse
# prior. Its own `off` twin isolates what the reset adds to that prior.
IN_FLIGHT_ARMS = (
    SWITCH_OFF,
    Method(
        "kpo-switch-inflate",
        "KPO length-matched, version_switch inflate (switch_q 1)",
        {**_KPO_MATCHED, "version_switch": "inflate", "switch_q": 1.0},
    ),
    Method(
        "kpo-diffuse-switch-off",
        "KPO length-matched, diffuse prior, version_switch off",
        {**_KPO_MATCHED, "p0": "diffuse"},
    ),
    Method(
        "kpo-diffuse-switch-reset",
        "KPO length-matched, diffuse prior, version_switch reset",
        {**_KPO_MATCHED, "p0": "diffuse", "version_switch": "reset"},
    ),
)
# Each arm's paired baseline in the in-flight phase: the same filter with the switch off.
SWITCH_BASELINES = {
    "kpo-switch-inflate": "kpo-switch-off",
    "kpo-diffuse-switch-reset": "kpo-diffuse-switch-off",
}

# The guard phase. Its stress is the pilot's learning rate at staleness 8, where the arms
# without a trust region collapsed in every seed of the earlier studies; GRPO did not.
GUARD_STRESS = STRESSES[0]
GUARD_ARMS = tuple(m for m in ARMS if m.key in ("grpo", "kpo-matched-unclipped", "kpo-q0"))
# The guard with its default objectives, rolling back; the remedy switches to the arm that did
# best under this stress in the earlier studies, KPO with the diffuse prior and the
# posterior-sd clip (a trust region), at half the step size. Three rollbacks, then the run
# stops as unstable.
GUARD_SECTION = {
    "enabled": True,
    "action": "rollback",
    "max_rollbacks": 3,
    "remedy": {"estimator": dict(_KPO_DIFFUSE), "lr_scale": 0.5},
}
GUARDED = Setting(
    f"{GUARD_STRESS.key}-guard",
    f"{GUARD_STRESS.label}, stability guard rolling back",
    {**GUARD_STRESS.overrides, "stability": GUARD_SECTION},
)
# The adaptive staleness bound against fixed ones: KPO with its defaults (the demo's estimator)
# at the base learning rate. No forced lead: generation runs ahead until the buffer is full,
# and a tighter bound drops more of what it made.
BOUND_ARM = Method("kpo", "KPO (defaults)", {"name": "kalman"})


def _bound_setting(key: str, label: str, bound: int | dict[str, Any]) -> Setting:
    pipeline = {"mode": "async", "max_staleness": bound, "lead_batches": 0}
    return Setting(key, label, {"pipeline": pipeline})


BOUND_SETTINGS = (
    *(_bound_setting(f"bound-{n}", f"max_staleness {n}", n) for n in (1, 4, 8)),
    _bound_setting("bound-auto", "max_staleness auto (1 to 8)", {"auto": {"min": 1, "max": 8}}),
)
SETTINGS = (*STRESSES, GENTLE, IN_FLIGHT, GUARDED, *BOUND_SETTINGS)
PHASES = ("pilot", "main", "gentle", "in-flight", "guard")


def pilot_cells() -> list[Cell]:
    return [Cell(GRPO, setting) for setting in STRESSES]


def arm_cells(setting: Setting) -> list[Cell]:
    return [Cell(method, setting) for method in ARMS]


def in_flight_cells() -> list[Cell]:
    return [Cell(method, IN_FLIGHT) for method in IN_FLIGHT_ARMS]


def guard_cells() -> list[Cell]:
    """Each guard arm without and with the guard, then the staleness bounds."""
    arms = [Cell(m, setting) for setting in (GUARD_STRESS, GUARDED) for m in GUARD_ARMS]
    return [*arms, *(Cell(BOUND_ARM, setting) for setting in BOUND_SETTINGS)]


def setting_named(key: str) -> Setting:
    for setting in SETTINGS:
        if setting.key == key:
            return setting
    valid = ", ".join(s.key for s in SETTINGS)
    raise ValueError(f"unknown setting {key!r}; valid settings: {valid}")


def cell_spec(base: RunSpec, cell: Cell, seed: int) -> RunSpec:
    """`base` with the cell's estimator, reference and setting applied, and `seed`."""
    data = base.model_dump(mode="json")
    data["name"] = f"{cell.key}-s{seed}"[:63]
    data["seed"] = seed
    data["algorithm"]["estimator"] = dict(cell.method.estimator)
    data["algorithm"]["reference"] = cell.method.reference
    data["algorithm"]["off_policy"] = dict(cell.method.off_policy)
    data["algorithm"]["loss_agg_mode"] = cell.method.loss_agg_mode
    for section, fields in cell.setting.overrides.items():
        data[section].update(fields)
    pipeline = data["pipeline"]
    # Let the setting size the buffer (the base spec resolved it for its own).
    pipeline["buffer_groups"] = 0
    if pipeline["mode"] == "sync":
        pipeline["lead_batches"] = 0
    return RunSpec.model_validate(data)
