"""The `stability` section: the run's stability guard (off by default).

Per learner step the guard (services/pipeline/guard.py) reads signals the metrics record
already carries (services/metrics.py) and compares each with an objective: entropy against its
running baseline and its trend, the clip fraction, the gradient norm against its running median,
non-finite tokens, the batch reward against its running baseline, held-out accuracy against the
best seen, and KPO's filtered switch frequency. An objective broken for `patience` consecutive
evaluations makes the guard act by `action`. Every objective may be null (not checked).

A run the guard paused resumes with a spec patch (`POST /v1/runs/{id}/resume`, or the run
directory's `resume.json`): spec-shaped, it may change only the remedy's targets
(`SPEC_PATCH_KEYS`); `RunSpec.patched` applies one, the functions here check and merge them.

The default bounds are derived from the stability study's recorded runs (docs/results/<study>/
metrics of the studies made before the guard acted: `guard_replay.REPLAYED`) by
benchmarks/stability_study/guard_replay.py; `python -m benchmarks.stability_study.guard_replay`
prints the derivation (docs/results.md, "The stability guard on the study's recorded runs").
Healthy runs are those of every arm and setting none of whose seeds collapsed by the study's
criterion (benchmarks/stability_study/summary.py), whether they learned or not. Each bound is
the most extreme value of its objective's compared quantity that any healthy run held for
`patience` consecutive evaluations, moved 25% further from the neutral value (1 for a ratio to a
baseline, 0 otherwise) and rounded away from the healthy runs to two significant figures: the
guard acts on none of them. `nonfinite_tokens_max` stays 0, as the study did not record the key.
They come from a 362k-parameter model on one arithmetic task (reward 0 or 1), and catch 17 of
its 18 collapsed runs, each after the collapse showed in held-out accuracy.
tests/services/pipeline/test_guard_study.py fails when the data or the rule no longer give them.
"""

from __future__ import annotations

import typing
from collections.abc import Mapping
from typing import Any, Literal

from pydantic import Field, field_validator

from kpo_core.config import EstimatorConfig, StrictModel
from services.spec.bounds import MAX_STALENESS, MAX_STEPS

# The guard keeps up to this many values per objective and saves them with every checkpoint:
# 10,000 steps of a signal is far more history than a running median needs, and keeps the
# saved state of every objective within a few hundred kilobytes.
MAX_BASELINE_WINDOW = 10_000
# Each rollback reloads a checkpoint (100 GB for an 8B model with its optimiser state): a run
# that rolled back 100 times will not become stable on the 101st.
MAX_ROLLBACKS = 100


# The dotted keys of the run spec that a resume's patch may set: what a remedy changes.
# `algorithm.estimator` takes a whole estimator object ({"name": ..., its settings}).
SPEC_PATCH_KEYS = ("learner.lr", "pipeline.max_staleness", "algorithm.estimator")


class SpecPatchError(ValueError):
    """A spec patch that sets keys no resume may change; `problems`: (dotted key, why) each."""

    def __init__(self, problems: list[tuple[str, str]]) -> None:
        super().__init__("; ".join(f"{key}: {why}" for key, why in problems))
        self.problems = problems


def flatten_patch(patch: Mapping[str, Any]) -> dict[str, Any]:
    """A spec-shaped patch as {dotted key: value}. Raises `SpecPatchError` naming every key
    outside `SPEC_PATCH_KEYS` (each leaf of a section none of whose keys may change)."""
    flat: dict[str, Any] = {}
    problems: list[tuple[str, str]] = []

    def walk(node: Mapping[str, Any], prefix: str) -> None:
        for key, value in node.items():
            path = f"{prefix}{key}"
            if path in SPEC_PATCH_KEYS:
                flat[path] = value
            elif any(allowed.startswith(f"{path}.") for allowed in SPEC_PATCH_KEYS):
                if isinstance(value, Mapping):
                    walk(value, f"{path}.")
                else:
                    problems.append((path, "must be a mapping of the keys below it to change"))
            elif isinstance(value, Mapping) and value:
                walk_refused(value, f"{path}.")
            else:
                problems.append((path, refused))

    def walk_refused(node: Mapping[str, Any], prefix: str) -> None:
        for key, value in node.items():
            if isinstance(value, Mapping) and value:
                walk_refused(value, f"{prefix}{key}.")
            else:
                problems.append((f"{prefix}{key}", refused))

    refused = f"a resume may change only {', '.join(SPEC_PATCH_KEYS)}"
    walk(patch, "")
    if problems:
        raise SpecPatchError(problems)
    return flat


def nest_patch(flat: Mapping[str, Any]) -> dict[str, Any]:
    """{dotted key: value} as a spec-shaped patch."""
    nested: dict[str, Any] = {}
    for dotted, value in flat.items():
        section, key = dotted.split(".", 1)
        nested.setdefault(section, {})[key] = value
    return nested


def merge_patches(base: Mapping[str, Any], more: Mapping[str, Any]) -> dict[str, Any]:
    """The patch of `base` then `more`: a key both set takes `more`'s value (an estimator is
    replaced whole)."""
    return nest_patch({**flatten_patch(base), **flatten_patch(more)})


def estimator_names() -> tuple[str, ...]:
    """The estimator names `algorithm.estimator.name` accepts, read from kpo_core's union."""
    union = typing.get_args(EstimatorConfig)[0]
    return tuple(member.model_fields["name"].default for member in typing.get_args(union))


class StabilityRemedy(StrictModel):
    """What the run changes when it resumes from a rollback; null keeps the run's setting."""

    lr_scale: float | None = Field(
        None,
        gt=0.0,
        le=1.0,
        description="multiply learner.lr by this after a rollback (e.g. 0.5)",
    )
    max_staleness: int | None = Field(
        None,
        ge=0,
        le=MAX_STALENESS,
        description="pipeline.max_staleness after a rollback (fresher batches)",
    )
    estimator: EstimatorConfig | None = Field(
        None,
        description="the training estimator after a rollback: a name (that estimator with its "
        "defaults) or a whole estimator object, e.g. {name: kalman, p0: diffuse, clip_mode: "
        "posterior}; it replaces the run's even when the name is the same",
    )

    @field_validator("estimator", mode="before")
    @classmethod
    def _estimator_by_name(cls, value: Any) -> Any:
        # A bare name is that estimator with its defaults; an unknown one is named with the
        # valid ones (the discriminated union's own message would only list tags).
        if isinstance(value, str):
            names = estimator_names()
            if value not in names:
                raise ValueError(f"unknown estimator {value!r}; valid: {', '.join(names)}")
            return {"name": value}
        return value


class StabilityObjectives(StrictModel):
    """The bounds the guard holds each signal to; null switches an objective off.

    An objective is evaluated only in a record that carries its key (services/metrics.py); a
    value that is not finite breaks it. Baselines are running medians over the last
    `baseline_window` steps in which the objective held, so a collapse does not drag its own
    baseline down.
    """

    entropy_min_fraction: float | None = Field(
        0.72,
        gt=0.0,
        lt=1.0,
        allow_inf_nan=False,
        description="`entropy` below this fraction of its running baseline breaks it",
    )
    entropy_slope_min: float | None = Field(
        -0.026,
        ge=-1.0,
        lt=0.0,
        allow_inf_nan=False,
        description="the least-squares slope of `entropy` over the last baseline_window "
        "steps, per step and relative to its running baseline, below this breaks it "
        "(-0.026: losing 2.6% of the baseline per step)",
    )
    clip_fraction_max: float | None = Field(
        0.79,
        ge=0.0,
        lt=1.0,
        allow_inf_nan=False,
        description="`clip_fraction` (tokens whose ratio was clipped) above this breaks it",
    )
    grad_norm_max_ratio: float | None = Field(
        2.5,
        gt=1.0,
        allow_inf_nan=False,
        description="`grad_norm` (before clipping) above this multiple of its running median "
        "breaks it",
    )
    nonfinite_tokens_max: float | None = Field(
        0.0,
        ge=0.0,
        allow_inf_nan=False,
        description="`nonfinite_tokens` (tokens masked for a NaN/inf log-prob or advantage, "
        "per pass) above this breaks it",
    )
    reward_drop_max: float | None = Field(
        0.16,
        gt=0.0,
        allow_inf_nan=False,
        description="`reward_mean` more than this below its running baseline (an absolute "
        "drop, in reward units) breaks it",
    )
    held_out_drop_max: float | None = Field(
        0.093,
        gt=0.0,
        le=1.0,
        allow_inf_nan=False,
        description="held-out `eval_accuracy_avg_at_k` more than this below the best seen "
        "breaks it (evaluated in the records an evaluation joins)",
    )
    switch_frequency_max: float | None = Field(
        0.096,
        ge=0.0,
        lt=1.0,
        allow_inf_nan=False,
        description="KPO only (records with `kalman_gain_mean`): `filtered_switch_frequency` "
        "above this breaks it; the other estimators' ratio is the token ratio, whose "
        "switching is the noise KPO filters",
    )
    truncated_fraction_max: float | None = Field(
        0.4,
        ge=0.0,
        lt=1.0,
        allow_inf_nan=False,
        description="`truncated_fraction` (responses cut at max_new_tokens) above this breaks "
        "it: a policy that collapses into degenerate text runs to the token budget. Set null "
        "for a task whose healthy responses often fill the budget",
    )
    approx_kl_max: float | None = Field(
        360.0,
        gt=0.0,
        allow_inf_nan=False,
        description="`approx_kl` (the k3 estimate of KL(behaviour || policy) in nats, the mean "
        "over the step's minibatches) above this breaks it; 360 is the study's tiny model under "
        "staleness 8, far past what a healthy run of a real model reaches: set your own",
    )


class StabilityConfig(StrictModel):
    """The stability guard: objectives on each step's signals, and what breaking one does."""

    enabled: bool = Field(False, description="run the guard (off: no objective is checked)")
    action: Literal["warn", "rollback", "pause", "cancel"] = Field(
        "warn",
        description="when an objective has been broken for `patience` steps: warn (log and "
        "record an event), rollback (resume from the newest healthy checkpoint, or step 0 "
        "when none is, and train on with `remedy` applied once more), pause (checkpoint, "
        "stop every actor and wait for a resume, which may patch learner.lr, "
        "pipeline.max_staleness and algorithm.estimator), or cancel the run",
    )
    patience: int = Field(
        3,
        ge=1,
        le=MAX_STEPS,
        description="consecutive broken evaluations of an objective before the guard acts; "
        "also the clean steps after a checkpoint that make it healthy, and after an action "
        "that re-arm the guard",
    )
    warmup_steps: int = Field(
        10,
        ge=0,
        le=MAX_STEPS,
        description="first steps whose values only form the baselines: no objective breaks "
        "in them, except on a value that is not finite",
    )
    baseline_window: int = Field(
        20,
        ge=3,
        le=MAX_BASELINE_WINDOW,
        description="steps of each running median, and of the entropy slope's fit",
    )
    max_rollbacks: int = Field(
        2,
        ge=0,
        le=MAX_ROLLBACKS,
        description="rollbacks of the run; the next broken objective stops it, failed as unstable",
    )
    max_healthy_age_steps: int = Field(
        50,
        ge=0,
        le=MAX_STEPS,
        description="at the first warning of an episode the guard asks for a checkpoint when "
        "the newest healthy one is older than this many steps (or there is none)",
    )
    remedy: StabilityRemedy = Field(
        default_factory=StabilityRemedy,
        description="what changes when the run resumes from a rollback",
    )
    objectives: StabilityObjectives = Field(
        default_factory=StabilityObjectives,
        description="the bounds on each step's signals",
    )
