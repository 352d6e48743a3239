"""The metrics record, declared once: every key of it, with its kind, unit and meaning.

Every learner step emits one record (DESIGN.md, data flow 6): the learner's `train_step` fills
most of it (services/learner/step.py and metrics.py), the driver adds progress, throughput,
staleness and the run's totals (`RunDriver._on_trained`, services/pipeline/driver.py). Whatever
reads the record by key reads this declaration:

- services/api/prometheus.py exports every key of kind gauge, counter or histogram under its
  `prometheus` name (label `run_id`; ratio diagnostics also `stage`, the shadow estimators' keys
  `estimator`);
- services/pipeline/plots.py draws the keys that name one of its panels (`plot`) in curves.png;
- the metrics table of docs/pipeline.md is `markdown_table()`, written by
  `python scripts/metrics_table.py` (a test fails when the two differ);
- tests/services/test_metrics.py checks that a real learner step and the driver write declared
  keys only, and that the learner writes every key declared as its own.

Prometheus names are DESIGN.md's with STYLE.md's suffixes (habit 9) where the two differ: a value
in [0, 1] has unit `ratio` and its name ends in `_ratio` (`kpo_clip_fraction_ratio`), a quantity
with a unit names it (`kpo_entropy_nats`), a counter ends in `_total`. `MetricKey` refuses a
declaration that breaks these rules. The exported names are a contract with deploy/ (Grafana
dashboard, Prometheus rules): renaming one breaks dashboards and alerts.

Not every key is in every record: those of an estimator or an option (Kalman, the proximal
reference, TIS/MIS, `algorithm.shadow`, truncated-sampling replay) only with it, `grad_norm`
only when a minibatch was trained; the notes of the table say which.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum


class Kind(StrEnum):
    """How a key leaves the record, besides metrics.jsonl, the store and the API."""

    GAUGE = "gauge"  # exported as the latest record's value
    COUNTER = "counter"  # a cumulative run total in every record, exported as a counter
    HISTOGRAM = "histogram"  # a duration of the step (or a list of them), exported as buckets
    RECORD = "record"  # not exported to Prometheus


class Source(StrEnum):
    """Who writes the key into the record."""

    LEARNER = "learner"  # LearnerCore.train_step (services/learner/step.py)
    DRIVER = "driver"  # RunDriver._on_trained (services/pipeline/driver.py)


# The ratio diagnostics (`staged` keys) are in the record twice, as `raw_<key>` (of exp(z)) and
# `filtered_<key>` (of the estimator's ratio); Prometheus has one family with a `stage` label.
STAGES = ("raw", "filtered")
# The estimators `algorithm.shadow` may list (kpo_core.config.ESTIMATOR_NAMES; this module
# imports nothing of the project): a shadow estimator's keys are `shadow_<estimator>_<key>`,
# one Prometheus family with an `estimator` label.
SHADOW_ESTIMATORS = ("token", "sequence", "geometric", "kalman", "cumulative")
# A unit that is named in the metric name: the exported name ends in `_<unit>` (or
# `_<unit>_total`), and a name ending that way has that unit.
NAMED_UNITS = ("seconds", "nats", "ratio", "bytes")


@dataclass(frozen=True)
class MetricKey:
    """One key of the metrics record (or, `staged`, the pair `raw_<key>`, `filtered_<key>`; or,
    `shadowed`, `shadow_<estimator>_<key>` per estimator).

    key: the record key; kind: `Kind`; unit: what the value counts or measures ("" when
    dimensionless; `ratio` for a value in [0, 1]); help: one line, the Prometheus HELP text of
    an exported key; source: `Source`; prometheus: the exported name (None for `Kind.RECORD`);
    staged: a ratio diagnostic (see STAGES); plot: the curves.png panel that draws it
    (services/pipeline/plots.py), if any; note: more for the docs table (when the key is absent,
    how minibatch values are reduced); shadowed: the estimators (of SHADOW_ESTIMATORS) whose
    shadow reports the key (`algorithm.shadow`), none for any other key.
    """

    key: str
    kind: Kind
    unit: str
    help: str
    source: Source
    prometheus: str | None = None
    staged: bool = False
    plot: str | None = None
    note: str = ""
    shadowed: tuple[str, ...] = ()
    # Labels of a counter exported from the run's events rather than its records: one series
    # per value of these (services/api/prometheus.py, `EVENT_COUNTERS`).
    event_labels: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        problem = self._problem() or self._shadow_problem()
        if problem:
            raise ValueError(f"metrics record key {self.key!r}: {problem}")

    def _problem(self) -> str | None:
        name = self.prometheus
        if self.kind is Kind.RECORD:
            return None if name is None else f"a {self.kind} key has no Prometheus name ({name})"
        if name is None:
            return f"a {self.kind} needs its Prometheus name (`prometheus=`)"
        if not name.startswith("kpo_"):
            return f"Prometheus name {name!r} must start with `kpo_`"
        base = name.removesuffix("_total")
        if (self.kind is Kind.COUNTER) != (base != name):
            return f"{name!r}: a counter's name, and only a counter's, ends in `_total`"
        if self.kind is Kind.HISTOGRAM and self.unit != "seconds":
            return f"a histogram holds durations (unit seconds), not {self.unit!r}"
        named = next((unit for unit in NAMED_UNITS if base.endswith(f"_{unit}")), None)
        if self.unit in NAMED_UNITS and named != self.unit:
            return f"{name!r} must end in `_{self.unit}` (its unit)"
        if named is not None and named != self.unit:
            return f"{name!r} ends in `_{named}`, so its unit must be {named!r}, not {self.unit!r}"
        if self.staged and self.kind is not Kind.GAUGE:
            return "a ratio diagnostic is a gauge or record-only"
        return None

    def _shadow_problem(self) -> str | None:
        unknown = sorted(set(self.shadowed) - set(SHADOW_ESTIMATORS))
        if unknown:
            return f"shadowed by unknown estimators {unknown} (not in SHADOW_ESTIMATORS)"
        if self.shadowed and self.staged:
            return "a key is staged or shadowed, not both"
        if self.shadowed and self.kind not in (Kind.GAUGE, Kind.RECORD):
            return "a shadow estimator's key is a gauge or record-only"
        return None

    @property
    def record_keys(self) -> tuple[str, ...]:
        """The keys this declaration stands for in a record."""
        if self.shadowed:
            return tuple(f"shadow_{name}_{self.key}" for name in self.shadowed)
        return tuple(f"{stage}_{self.key}" for stage in STAGES) if self.staged else (self.key,)


@dataclass(frozen=True)
class Group:
    """A group of keys, one block of the docs table."""

    title: str  # Markdown, as the docs table shows it
    keys: tuple[MetricKey, ...]


_L, _D = Source.LEARNER, Source.DRIVER


def _gauge(
    key: str,
    name: str,
    unit: str,
    help: str,
    source: Source = _L,
    *,
    plot: str | None = None,
    note: str = "",
) -> MetricKey:
    return MetricKey(key, Kind.GAUGE, unit, help, source, name, plot=plot, note=note)


def _counter(key: str, name: str, unit: str, help: str, note: str = "") -> MetricKey:
    return MetricKey(key, Kind.COUNTER, unit, help, _D, name, note=note)


def _record(key: str, unit: str, help: str, source: Source = _L, note: str = "") -> MetricKey:
    return MetricKey(key, Kind.RECORD, unit, help, source, note=note)


PROGRESS = Group(
    "progress",
    (
        _record("step", "steps", "Learner steps done in the run: the record's index.", _D),
        _gauge("policy_version", "kpo_policy_version", "versions", "The learner's policy version."),
        _gauge(
            "time",
            "kpo_last_step_timestamp_seconds",
            "seconds",
            "Unix time of the latest learner step.",
            _D,
        ),
        _record(
            "wall_seconds",
            "seconds",
            "Wall time of the run so far.",
            _D,
            note="Earlier attempts of a resumed run included.",
        ),
        MetricKey(
            "step_seconds",
            Kind.HISTOGRAM,
            "seconds",
            "Duration of learner steps.",
            _D,
            "kpo_learner_step_seconds",
            note="From the call to the learner to its result.",
        ),
        _record("lr", "", "Learning rate the step used."),
        _gauge(
            "learner_idle_seconds",
            "kpo_learner_idle_seconds",
            "seconds",
            "Time the learner waited between the end of its previous step and the start of "
            "this one (a batch not ready, or a publish or checkpoint before the step).",
            note="Measured on learner rank 0; absent from a run's or an attempt's first step.",
        ),
        _record(
            "publish_seconds",
            "seconds",
            "Seconds the latest finished publish took: read, encode and put (object store) or "
            "send (collective) the weights.",
            note="Learner rank 0; the publish of the version before this step's.",
        ),
        _record(
            "publish_bytes",
            "bytes",
            "Bytes the latest finished publish put into the object store, or broadcast "
            "(collective, headers and tags included): the patches with "
            "`pipeline.weight_delta: auto`, the whole weights otherwise.",
        ),
        _record(
            "publish_changed_fraction",
            "",
            "Fraction of the published weights' bytes that changed since the version before "
            "(1 for a publish sent whole).",
        ),
    ),
)
# The keys a held-out evaluation adds to the record it joins (services/pipeline/evaluation.py).
EVAL_KEYS = ("eval_accuracy_avg_at_k", "eval_pass_at_k", "eval_step")
REWARD = Group(
    "reward",
    (
        _gauge(
            "reward_mean",
            "kpo_reward_mean",
            "",
            "Mean reward of the latest step's batch.",
            plot="reward",
        ),
        _record(
            "reward_std",
            "",
            "Population standard deviation of the batch's rewards.",
            note="NaN/inf rewards left out, as of `reward_mean` (both 0.0 when none is finite).",
        ),
        _gauge(
            "accuracy",
            "kpo_accuracy_ratio",
            "ratio",
            "Fraction of correct responses (latest step).",
        ),
        _gauge(
            "eval_accuracy_avg_at_k",
            "kpo_eval_accuracy_avg_at_k_ratio",
            "ratio",
            "Held-out avg@k: mean over prompts of the fraction of k samples correct.",
            _D,
            plot="reward",
            note="With `eval`, in the first record after an evaluation ends (of `eval_step`).",
        ),
        _gauge(
            "eval_pass_at_k",
            "kpo_eval_pass_at_k_ratio",
            "ratio",
            "Held-out pass@k: fraction of prompts with a correct sample among k.",
            _D,
            plot="reward",
            note="As `eval_accuracy_avg_at_k`.",
        ),
        _record(
            "eval_step",
            "steps",
            "The learner step whose policy the evaluation in this record sampled.",
            _D,
            note="As `eval_accuracy_avg_at_k`; with in-flight updates, later versions may "
            "sample some of its tokens.",
        ),
        _record(
            "zero_variance_group_fraction",
            "ratio",
            "Fraction of groups whose finite rewards are all equal (no GRPO learning signal).",
        ),
        _record(
            "response_length_mean",
            "tokens",
            "Mean response length of the batch, in model tokens (observation tokens left out).",
        ),
        _record(
            "truncated_fraction",
            "ratio",
            "Fraction of responses cut by a limit (tokens, context, turns, calls).",
        ),
    ),
)
OPTIMISATION = Group(
    "optimisation",
    (
        _gauge(
            "policy_loss",
            "kpo_policy_loss",
            "",
            "Policy-gradient loss of the latest step.",
            note="Mean over minibatches.",
        ),
        _gauge(
            "entropy",
            "kpo_entropy_nats",
            "nats",
            "Mean token entropy of the policy, in nats.",
            plot="entropy",
            note="Over the first epoch (each row once).",
        ),
        _gauge(
            "clip_fraction",
            "kpo_clip_fraction_ratio",
            "ratio",
            "Fraction of tokens whose ratio was clipped.",
            plot="clip fraction",
        ),
        _gauge(
            "approx_kl",
            "kpo_kl_nats",
            "nats",
            "Approximate KL(behaviour || policy), in nats.",
            note="The k3 estimator, mean over minibatches.",
        ),
        _gauge(
            "grad_norm",
            "kpo_grad_norm",
            "",
            "Gradient norm before clipping (latest step).",
            note="Mean over trained minibatches; absent when none was trained.",
        ),
    ),
)
BAD_NUMBERS = Group(
    "bad numbers ([numerics.md](numerics.md))",
    (
        _record("nonfinite_rewards", "responses", "Responses whose reward was NaN/inf (dropped)."),
        _record(
            "nonfinite_tokens",
            "tokens",
            "Tokens masked for a NaN/inf log-prob or advantage.",
            note="Per pass over the batch (summed over minibatches, divided by the epochs).",
        ),
        _record(
            "extreme_ratio_tokens",
            "tokens",
            "Tokens whose |log-ratio| exceeded 20 (saturated).",
            note="Per pass over the batch (summed over minibatches, divided by the epochs).",
        ),
        _record("empty_responses", "responses", "Responses without a model token."),
        _record(
            "skipped_minibatches",
            "minibatches",
            "Minibatches whose loss or gradient was not finite, skipped without an update.",
        ),
        _record(
            "empty_minibatches", "minibatches", "Minibatches without a valid token (no update)."
        ),
        # Run totals of the counts above: the driver sums `<key>` into `<key>_total`.
        _counter(
            "nonfinite_rewards_total",
            "kpo_nonfinite_rewards_total",
            "responses",
            "Responses whose reward was not finite, left out of training.",
        ),
        _counter(
            "nonfinite_tokens_total",
            "kpo_nonfinite_tokens_total",
            "tokens",
            "Tokens masked for a log-prob that was not finite.",
        ),
        _counter(
            "extreme_ratio_tokens_total",
            "kpo_extreme_ratio_tokens_total",
            "tokens",
            "Tokens whose log-ratio exceeded the extreme-ratio threshold (|z| > 20).",
        ),
        _counter(
            "skipped_minibatches_total",
            "kpo_skipped_minibatches_total",
            "minibatches",
            "Minibatches whose loss or gradient was not finite, skipped without an update.",
        ),
    ),
)
REPLAY = Group(
    "truncated sampling replayed (only with `algorithm.off_policy.truncated_sampling: replay`)",
    (
        _record(
            "replay_kept_mean",
            "tokens",
            "Mean size of the kept sets (top-k / top-p / min-p) the learner normalised the "
            "batch's log-probs over.",
            note="Over the model tokens whose set was recorded; once per step.",
        ),
        _record(
            "replay_kept_p99",
            "tokens",
            "99th percentile (nearest rank) of the kept-set sizes of the batch.",
            note="As `replay_kept_mean`; near `generation.replay_max_kept`, raise it.",
        ),
        _record(
            "replay_dropped_tokens",
            "tokens",
            "Model tokens dropped from the loss because their kept set had more ids than "
            "`generation.replay_max_kept` (not recorded).",
            note="Once per step; counted in tokens_trained, not in nonfinite_tokens.",
        ),
    ),
)
RATIOS = Group(
    "ratios",
    (
        _record("ratio_mean", "", "Mean of the estimator's ratio over valid tokens."),
        _record(
            "onpolicy_ratio_mean",
            "",
            "Mean token ratio pi/pi_behaviour over the tokens the learner's own weights sampled "
            "(staleness 0), before the step moved them: 1 when the learner scores exactly the "
            "distribution its sampler drew from, the kept mass S below 1 for truncated sampling "
            "without replay.",
            note="Absent where no token of the batch had staleness 0.",
        ),
        _record(
            "onpolicy_ratio_std",
            "",
            "Standard deviation of the token ratio over the tokens of `onpolicy_ratio_mean`.",
            note="Float rounding alone gives about 1e-5.",
        ),
        _record(
            "onpolicy_tokens",
            "tokens",
            "Tokens behind `onpolicy_ratio_mean`: sampled by the learner's current weights, "
            "in the rows scored before the step's first update.",
        ),
        _record("ratio_max", "", "Largest estimator ratio.", note="Max over minibatches."),
        _record("ratio_min", "", "Smallest estimator ratio.", note="Min over minibatches."),
        _record(
            "kalman_gain_mean",
            "",
            "Mean Kalman gain over valid tokens.",
            note="KPO (`kalman`) only.",
        ),
        _record(
            "kalman_shrinkage_mean",
            "",
            "Mean over valid tokens of W_t = 1 - prod(1 - K): the weight the filtered log-ratio "
            "gives the observations so far (0: still the prior, 1: none left on it).",
            note="KPO (`kalman`) only.",
        ),
        _record(
            "filtered_ratio_mean",
            "",
            "Mean filtered ratio exp(x_t) over valid tokens.",
            note="KPO (`kalman`) only.",
        ),
        _record(
            "token_backstop_fraction",
            "",
            "Fraction of valid tokens the token backstop took the gradient from.",
            note="KPO with `token_clip` only; also counted in clip_fraction.",
        ),
        _record(
            "behaviour_weight_mean",
            "",
            "Mean decoupled-PPO weight pi_prox / pi_behaviour.",
            note="With `algorithm.reference: proximal` only.",
        ),
        _record(
            "behaviour_weight_max",
            "",
            "Largest decoupled-PPO weight.",
            note="With `algorithm.reference: proximal` only.",
        ),
        _record(
            "tis_truncated_fraction",
            "ratio",
            "Fraction of tokens whose behaviour weight was truncated at `tis_cap`.",
            note="With the proximal reference and `off_policy.tis_cap` only.",
        ),
        _record(
            "mis_masked_fraction",
            "ratio",
            "Fraction of tokens whose behaviour weight was zeroed outside [mis_low, mis_high].",
            note="With the proximal reference and `off_policy.mis_low`/`mis_high` only.",
        ),
    ),
)


def _diagnostic(key: str, unit: str, help: str, name: str | None = None) -> MetricKey:
    kind = Kind.RECORD if name is None else Kind.GAUGE
    return MetricKey(key, kind, unit, help, _L, name, staged=True)


RATIO_DIAGNOSTICS = Group(
    "ratio diagnostics (`raw_`: of exp(z); `filtered_`: of the estimator's ratio)",
    (
        _diagnostic(
            "switch_frequency",
            "ratio",
            "Share of adjacent token pairs whose ratio switches side of 1 (raw: exp(z); "
            "filtered: the estimator's ratio).",
            "kpo_ratio_switch_frequency_ratio",
        ),
        _diagnostic("run_length_up", "tokens", "Mean length of runs of ratios above 1."),
        _diagnostic("run_length_down", "tokens", "Mean length of runs of ratios below 1."),
        _diagnostic("run_length_on", "tokens", "Mean length of runs of ratios near 1."),
        _diagnostic(
            "low_frequency_ratio",
            "ratio",
            "Share of the log-ratio's spectral energy at low frequencies.",
            "kpo_ratio_low_frequency_ratio",
        ),
        _diagnostic("global_variance", "", "Mean variance of the ratios within a response."),
        _diagnostic("local_variance", "", "Mean variance of the ratios within 50-token windows."),
    ),
)
STALENESS = Group(
    "staleness",
    (
        _gauge(
            "staleness_mean",
            "kpo_staleness_mean",
            "versions",
            "Mean staleness of the trained batch, in versions.",
            plot="staleness (versions)",
        ),
        _gauge(
            "staleness_max",
            "kpo_staleness_max",
            "versions",
            "Largest staleness in the trained batch, in versions.",
            plot="staleness (versions)",
        ),
        _record(
            "version_span_mean",
            "versions",
            "Policy versions that sampled the tokens of one trained response, mean.",
            _D,
            note="1 = every response was sampled by a single version; above 1 only with "
            "pipeline.in_flight_updates.",
        ),
        _record(
            "version_span_max",
            "versions",
            "Policy versions that sampled the tokens of one trained response, largest.",
            _D,
        ),
        _counter(
            "rollouts_dropped_stale",
            "kpo_rollouts_dropped_stale_total",
            "responses",
            "Responses dropped for exceeding the staleness bound.",
        ),
        _counter(
            "groups_dropped_stale",
            "kpo_groups_dropped_stale_total",
            "groups",
            "Response groups dropped for exceeding the staleness bound.",
        ),
        _counter(
            "rollouts_dropped_invalid",
            "kpo_rollouts_dropped_invalid_total",
            "responses",
            "Responses never generated because their prompt was refused by a generation worker.",
            note="group_size per prompt counted in groups_dropped_invalid.",
        ),
        _counter(
            "groups_dropped_invalid",
            "kpo_groups_dropped_invalid_total",
            "groups",
            "Prompts a generation worker refused (dropped, not retried; reliability.md).",
            note="Prompts too long for the engine's context, and requests its backend refused.",
        ),
        _counter(
            "prompts_too_long",
            "kpo_prompts_too_long_total",
            "groups",
            "Prompts dropped because they leave no room for a response in the engine's context.",
            note="Counted in groups_dropped_invalid too.",
        ),
        _gauge(
            "buffer_groups",
            "kpo_buffer_groups",
            "groups",
            "Scored groups waiting in the buffer.",
            _D,
        ),
        _gauge(
            "staleness_bound",
            "kpo_staleness_bound",
            "versions",
            "The adaptive staleness bound in force for the batches taken after this step.",
            _D,
            note="Only with `pipeline.max_staleness: {auto: ...}` (services/pipeline/"
            "staleness.py); the step's own batch was taken under the previous record's bound.",
        ),
        _counter(
            "staleness_bound_changes_total",
            "kpo_staleness_bound_changes_total",
            "changes",
            "Times the adaptive staleness bound moved (tightened or loosened) in the run.",
            note="Only with `pipeline.max_staleness: {auto: ...}`.",
        ),
    ),
)
FAULTS = Group(
    "faults survived (totals of the run; [reliability.md](reliability.md))",
    (
        _counter(
            "learner_restarts",
            "kpo_learner_restarts_total",
            "restarts",
            "Times the run resumed itself from a checkpoint after its learner died.",
        ),
        _counter(
            "generation_replacements",
            "kpo_generation_replacements_total",
            "actors",
            "Generation actors replaced after they died.",
        ),
        _counter(
            "standby_promotions",
            "kpo_standby_promotions_total",
            "actors",
            "Lost generation actors whose place a warm standby took (of generation_replacements).",
            note="Always 0 without `generation.standby`; each promotion is also a "
            "`generation.standby_promoted` event.",
        ),
        _counter(
            "verifier_replacements",
            "kpo_verifier_replacements_total",
            "actors",
            "Verifier actors replaced after they died or hung.",
        ),
        _counter(
            "rescored_groups",
            "kpo_rescored_groups_total",
            "groups",
            "Response groups scored again because their verifier actor died or hung.",
        ),
        _counter(
            "unverified_groups",
            "kpo_unverified_groups_total",
            "groups",
            "Response groups marked unverified (reward 0) after their verifier failed twice.",
        ),
    ),
)
GUARD = Group(
    "stability guard (only with `stability.enabled`; services/pipeline/guard.py)",
    (
        _gauge(
            "guard_broken_objectives",
            "kpo_guard_broken_objectives",
            "objectives",
            "Stability objectives broken at this step, acted on or not.",
            _D,
        ),
        MetricKey(
            "guard_actions_total",
            Kind.COUNTER,
            "actions",
            "Actions the stability guard (and the alerts that act) took in the run: warn, "
            "checkpoint, rollback, pause, cancel, stop_unstable.",
            _D,
            "kpo_guard_actions_total",
            note="exported from the run's `guard.action` events, labelled `reason` (the "
            "objective, or `alert <alertname>`) and `action`",
            event_labels=("reason", "action"),
        ),
        _gauge(
            "guard_rollbacks",
            "kpo_guard_rollbacks",
            "rollbacks",
            "Rollbacks of the run so far (stability.max_rollbacks at most).",
            _D,
        ),
        _counter(
            "rollouts_rolled_back_total",
            "kpo_rollouts_rolled_back_total",
            "responses",
            "Responses sampled after the checkpoint a rollback returned to: dropped, whether "
            "trained on, buffered or in flight.",
        ),
    ),
)
THROUGHPUT = Group(
    "throughput",
    (
        _record(
            "tokens_trained",
            "tokens",
            "Model tokens of the responses in the step's batch (observation tokens left out).",
            note="Once per step, whatever the epochs; tokens the loss masks for a NaN/inf "
            "reward or log-prob included.",
        ),
        _record(
            "observation_tokens",
            "tokens",
            "Observation (tool output) tokens of the responses in the step's batch: context "
            "for the model tokens after them, not trained on.",
            note="Once per step, whatever the epochs.",
        ),
        _counter(
            "tokens_trained_total",
            "kpo_tokens_trained_total",
            "tokens",
            "Model tokens of the responses trained on.",
        ),
        _counter(
            "tokens_generated_total",
            "kpo_tokens_generated_total",
            "tokens",
            "Response tokens generated.",
        ),
        _record(
            "generation_tokens_per_s",
            "tokens/s",
            "Tokens generated per second since the previous step.",
            _D,
        ),
        MetricKey(
            "generation_batch_seconds",
            Kind.HISTOGRAM,
            "seconds",
            "Seconds from handing a group to a generation worker to its G responses ending.",
            _D,
            "kpo_generation_batch_seconds",
            note="Mean of the groups that ended since the previous step (0 if none did).",
        ),
        _record("generation_batches", "groups", "Groups that ended since the previous step.", _D),
        _gauge(
            "generation_workers",
            "kpo_generation_workers",
            "actors",
            "Generation workers in the pool (a worker draining to leave it not counted).",
            _D,
            note="num_workers for a fixed pool; with `generation.actors`, within its [min, max] "
            "(services/pipeline/elastic.py).",
        ),
        _counter(
            "generation_pool_grows_total",
            "kpo_generation_pool_grows_total",
            "decisions",
            "Times the elastic pool grew by a worker (learner starved for data).",
            note="0 for a fixed pool; counted in the current driver's attempts.",
        ),
        _counter(
            "generation_pool_shrinks_total",
            "kpo_generation_pool_shrinks_total",
            "decisions",
            "Times the elastic pool shrank by a worker (batches waiting for the learner).",
            note="As `generation_pool_grows_total`.",
        ),
    ),
)
LEARNER_GROUP = Group(
    "learner group",
    (
        _record(
            "micro_batches",
            "forward passes",
            "Forward passes each learner rank ran in the step (the maximum over ranks).",
        ),
        _record("learner_world_size", "ranks", "Ranks in the learner group."),
    ),
)

TOOLS = Group(
    "tools (runs with `tools.enabled`)",
    (
        _gauge(
            "tool_calls_per_response",
            "kpo_tool_calls_per_response",
            "calls",
            "Tool calls per response of the step's batch (calls the limits refused not counted).",
            _D,
            plot="tools",
        ),
        _gauge(
            "tool_error_fraction",
            "kpo_tool_error_ratio",
            "ratio",
            "Fraction of the batch's tool calls that failed: an error, a timeout, a refusal, "
            "or no sandbox.",
            _D,
            plot="tools",
        ),
        _gauge(
            "turns_mean",
            "kpo_turns_mean",
            "turns",
            "Model turns per response (tool calls + 1).",
            _D,
        ),
        _gauge(
            "observation_token_fraction",
            "kpo_observation_token_ratio",
            "ratio",
            "Fraction of the batch's response tokens that are tool output (no loss).",
            _D,
            plot="tools",
        ),
    ),
)


def _shadow(
    key: str,
    unit: str,
    help: str,
    name: str | None = None,
    estimators: tuple[str, ...] = SHADOW_ESTIMATORS,
    note: str = "",
) -> MetricKey:
    kind = Kind.RECORD if name is None else Kind.GAUGE
    return MetricKey(key, kind, unit, help, _L, name, note=note, shadowed=estimators)


# What each estimator of `algorithm.shadow` would have reported on the step's batch, from the
# same log-probs (docs/pipeline.md, "Shadow estimators"); reduced as the training estimator's key
# of the same name.
SHADOW = Group(
    "shadow estimators (only with `algorithm.shadow`)",
    (
        _shadow(
            "policy_loss",
            "",
            "Policy-gradient loss of a shadow estimator on the step's batch (not trained on).",
            "kpo_shadow_policy_loss",
            note="Aggregated as a run training with it would (`algorithm.loss_agg_mode`, else "
            "the estimator's default); mean over minibatches.",
        ),
        _shadow(
            "clip_fraction",
            "ratio",
            "Fraction of tokens a shadow estimator would have clipped.",
            "kpo_shadow_clip_fraction_ratio",
        ),
        _shadow("ratio_mean", "", "Mean of a shadow estimator's ratio over valid tokens."),
        _shadow("ratio_max", "", "Largest shadow estimator ratio.", note="Max over minibatches."),
        _shadow("ratio_min", "", "Smallest shadow estimator ratio.", note="Min over minibatches."),
        _shadow(
            "kalman_gain_mean",
            "",
            "Mean Kalman gain of the KPO shadow over valid tokens.",
            estimators=("kalman",),
        ),
        _shadow(
            "kalman_shrinkage_mean",
            "",
            "Mean shrinkage W_t of the KPO shadow over valid tokens.",
            estimators=("kalman",),
        ),
        _shadow(
            "filtered_ratio_mean",
            "",
            "Mean filtered ratio exp(x_t) of the KPO shadow over valid tokens.",
            estimators=("kalman",),
        ),
        _shadow(
            "switch_frequency",
            "ratio",
            "Share of adjacent token pairs whose shadow estimator ratio switches side of 1.",
            "kpo_shadow_ratio_switch_frequency_ratio",
        ),
        _shadow("run_length_up", "tokens", "Mean length of runs of shadow ratios above 1."),
        _shadow("run_length_down", "tokens", "Mean length of runs of shadow ratios below 1."),
        _shadow("run_length_on", "tokens", "Mean length of runs of shadow ratios near 1."),
        _shadow(
            "low_frequency_ratio",
            "ratio",
            "Share of the shadow estimator log-ratio's spectral energy at low frequencies.",
            "kpo_shadow_ratio_low_frequency_ratio",
        ),
        _shadow("global_variance", "", "Mean variance of the shadow ratios within a response."),
        _shadow(
            "local_variance", "", "Mean variance of the shadow ratios within 50-token windows."
        ),
    ),
)

# The keys a record holds only in a run with `tools.enabled`.
TOOL_KEYS = tuple(metric.key for metric in TOOLS.keys)
# The keys a record holds only in a run that replays truncated sampling.
REPLAY_KEYS = tuple(metric.key for metric in REPLAY.keys)
# The keys a record holds only in a run with `algorithm.shadow` (those of its estimators).
SHADOW_KEYS = tuple(key for metric in SHADOW.keys for key in metric.record_keys)

GROUPS = (
    PROGRESS,
    REWARD,
    OPTIMISATION,
    BAD_NUMBERS,
    REPLAY,
    RATIOS,
    RATIO_DIAGNOSTICS,
    STALENESS,
    FAULTS,
    GUARD,
    THROUGHPUT,
    LEARNER_GROUP,
    TOOLS,
    SHADOW,
)
# Every declaration, in the docs table's order.
RECORD: tuple[MetricKey, ...] = tuple(metric for group in GROUPS for metric in group.keys)
# Every key a record may hold, to its declaration.
BY_KEY: dict[str, MetricKey] = {key: metric for metric in RECORD for key in metric.record_keys}

# Per-step counts of the learner's record that the driver sums into run totals named
# `<key>_total`: the counters of BAD_NUMBERS.
LEARNER_TOTALS = tuple(
    metric.key.removesuffix("_total") for metric in BAD_NUMBERS.keys if metric.kind is Kind.COUNTER
)
# Faults the run survived: run totals the driver keeps and writes into every record.
FAULT_COUNTERS = tuple(metric.key for metric in FAULTS.keys)
# The stability guard's keys: in the records of a run with `stability.enabled` only.
GUARD_KEYS = tuple(metric.key for metric in GUARD.keys)
# The adaptive staleness bound's keys: in the records of a run with
# `pipeline.max_staleness: {auto: ...}` only.
STALENESS_AUTO_KEYS = ("staleness_bound", "staleness_bound_changes_total")


def exported(
    kind: Kind, staged: bool = False, shadowed: bool = False, from_events: bool = False
) -> tuple[MetricKey, ...]:
    """The declarations of `kind` exported to Prometheus, with or without a `stage` label, with
    or without an `estimator` label (`shadowed`), from the records or the run's events
    (`from_events`: those with `event_labels`)."""
    return tuple(
        m
        for m in RECORD
        if m.kind is kind
        and m.prometheus
        and m.staged is staged
        and bool(m.shadowed) is shadowed
        and bool(m.event_labels) is from_events
    )


def _check_declaration() -> None:
    keys = [key for metric in RECORD for key in metric.record_keys]
    names = [metric.prometheus for metric in RECORD if metric.prometheus]
    for what, values in (("record key", keys), ("Prometheus name", names)):
        repeated = sorted({v for v in values if values.count(v) > 1})
        if repeated:
            raise ValueError(f"declared twice in services/metrics.py ({what}): {repeated}")
    for key in LEARNER_TOTALS:
        if key not in BY_KEY or BY_KEY[key].source is not Source.LEARNER:
            raise ValueError(f"the run total {key}_total sums an undeclared learner key {key!r}")
    undeclared = [key for key in STALENESS_AUTO_KEYS if BY_KEY.get(key) not in STALENESS.keys]
    if undeclared:
        raise ValueError(f"adaptive staleness keys not declared in STALENESS: {undeclared}")


_check_declaration()


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def _exported_as(metric: MetricKey) -> str:
    if metric.prometheus is None:
        return ""
    label = ", label `stage`" if metric.staged else ""
    if metric.shadowed:
        label = ", label `estimator`"
    return f"{metric.kind} `{metric.prometheus}`{label}"


def markdown_table() -> str:
    """The metrics table of docs/pipeline.md: a row per declaration, grouped as GROUPS."""
    lines = [
        "| key | unit | Prometheus | meaning |",
        "| --- | --- | --- | --- |",
    ]
    for group in GROUPS:
        lines.append(f"| **{group.title}** | | | |")
        for metric in group.keys:
            keys = ", ".join(f"`{key}`" for key in metric.record_keys)
            meaning = f"{metric.help} {metric.note}".strip()
            row = (keys, metric.unit, _exported_as(metric), meaning)
            lines.append("| " + " | ".join(_cell(cell) for cell in row) + " |")
    return "\n".join(lines)
