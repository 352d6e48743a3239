"""The run spec: what one run is made of, shared by YAML run files and the REST API.

A `RunSpec` is the algorithm (`kpo_core.config.AlgorithmConfig`, the pure library's) plus what
only the service knows: the model, the task, generation, reward, the learner, the pipeline,
evaluation and tracking. Every model is strict (`extra="forbid"`): a typo in a key is an error
naming the key, and a bad value is an error naming the field and the valid values. The names a
field accepts (generation backends, verifiers, dataset formats) are read from the services'
registries, so a bad name in a run file is a validation error listing the valid ones rather
than a failure inside an actor, and no second list has to be kept in step.

Every count, list and free-text string has an upper bound (the MAX_* constants of `bounds.py`):
a run spec may come from any client of the API, and none may ask the cluster for an unbounded
amount of work, memory, disk or scheduling. The bounds are far above what a run of a 4B-8B model
on a large GPU cluster asks for; past one, the error names the field and the bound.

One module per section (`task`, `generation`, `reward`, `learner`, `pipeline`, `tracking`,
`eval`, `tools`, `stability`); this one holds `RunSpec`, the checks across sections, and
re-exports every section's names, so `from services.spec import ...` reads as before.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pydantic import Field, ValidationError, ValidationInfo, field_validator, model_validator
from pydantic_core import InitErrorDetails, PydanticCustomError

from kpo_core.config import AlgorithmConfig, StrictModel
from services.spec.bounds import (
    MAX_ACTORS,
    MAX_BATCH_GROUPS,
    MAX_BUFFER_GROUPS,
    MAX_CPUS_PER_ACTOR,
    MAX_CUSTOM_RESOURCE_AMOUNT,
    MAX_CUSTOM_RESOURCES,
    MAX_GPUS_PER_ACTOR,
    MAX_GROUP_SIZE,
    MAX_LIST_ITEMS,
    MAX_NAME_CHARS,
    MAX_PATH_CHARS,
    MAX_PROMPTS_PER_BATCH,
    MAX_RESPONSE_TOKENS,
    MAX_SEED,
    MAX_STALENESS,
    MAX_STEPS,
    MAX_TEMPERATURE,
    MAX_TEXT_CHARS,
    MAX_TOKEN_BUDGET,
    RAY_BUILTIN_RESOURCES,
    AttnImplementation,
    CustomResources,
    NameItem,
    NameText,
    PathText,
)
from services.spec.eval import EvalConfig
from services.spec.generation import BackendName, BackendOption, GenerationConfig
from services.spec.learner import LearnerConfig, LoraConfig
from services.spec.pipeline import PipelineConfig
from services.spec.reward import RewardConfig, VerifierName
from services.spec.stability import (
    SPEC_PATCH_KEYS,
    SpecPatchError,
    StabilityConfig,
    StabilityObjectives,
    StabilityRemedy,
    flatten_patch,
    merge_patches,
)
from services.spec.task import ArithTask, DatasetTask, JsonlTask, TaskConfig
from services.spec.tracking import (
    MlflowTracking,
    TensorboardTracking,
    TrackingConfig,
    WandbTracking,
)
from services.tools.config import (
    MAX_TOOL_CONCURRENCY,
    MAX_TOOL_OUTPUT_CHARS,
    MAX_TOOL_TIMEOUT_S,
    MAX_TOOL_TURNS,
    EnvVarName,
    SandboxUrl,
    ToolsConfig,
)

# The validation context of a spec made by `RunSpec.remedied`.
REMEDIED = "remedied"


class RunSpec(StrictModel):
    """One RL run: the body of `POST /v1/runs` and the schema of a YAML run file."""

    name: str = Field(
        "run", pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$", description="a label for the run"
    )
    seed: int = Field(0, ge=0, le=MAX_SEED)
    model: PathText = Field(
        "tiny-arith",
        description="a built-in model name (tiny-arith), a local Hugging Face model directory, "
        "or a hub id (org/name), downloaded once by the driver into the Hugging Face cache",
    )
    model_revision: NameText | None = Field(
        None,
        description="branch, tag or commit of a hub model (default: main)",
    )
    task: TaskConfig = Field(default_factory=ArithTask)
    generation: GenerationConfig = Field(default_factory=GenerationConfig)
    reward: RewardConfig = Field(default_factory=RewardConfig)
    learner: LearnerConfig = Field(default_factory=LearnerConfig)
    # Validated even as the default: `_truncated_sampling_resolved` fills in its mode.
    algorithm: AlgorithmConfig = Field(default_factory=AlgorithmConfig, validate_default=True)
    pipeline: PipelineConfig = Field(default_factory=PipelineConfig)
    eval: EvalConfig | None = Field(
        None, description="held-out evaluation during the run (off when absent)"
    )
    tools: ToolsConfig = Field(
        default_factory=ToolsConfig,
        description="tool-integrated (multi-turn) rollouts with a sandboxed Python tool; off "
        "by default",
    )
    tracking: TrackingConfig = Field(
        default_factory=TrackingConfig,
        description="experiment trackers (W&B, MLflow, TensorBoard) that mirror every metrics "
        "record; none by default",
    )
    stability: StabilityConfig = Field(
        default_factory=StabilityConfig,
        description="the stability guard: objectives on each step's signals, and what "
        "breaking one does (warn, rollback, pause, cancel); off by default",
    )

    @field_validator("algorithm")
    @classmethod
    def _truncated_sampling_resolved(
        cls, algorithm: AlgorithmConfig, info: ValidationInfo
    ) -> AlgorithmConfig:
        # Unset, truncated training sampling is replayed: resolved here, where the generation
        # section (validated before this one) is known, so that the stored spec says so.
        generation = info.data.get("generation")
        off_policy = algorithm.off_policy
        if off_policy.truncated_sampling is not None or generation is None:
            return algorithm
        if not generation.truncated:
            return algorithm
        replay = off_policy.model_copy(update={"truncated_sampling": "replay"})
        return algorithm.model_copy(update={"off_policy": replay})

    @model_validator(mode="after")
    def _truncated_sampling_declared(self) -> RunSpec:
        # Without replay the learner's log-probs are of the full softmax (services/learner/
        # logprobs.py): with top-p/top-k/min-p the behaviour log-probs are of a renormalised
        # subset, every on-policy ratio falls below 1, and the loss is biased without a word.
        # So that is a choice; replay corrects it (both backends record the kept sets).
        mode = self.algorithm.off_policy.truncated_sampling
        truncated = self.generation.truncated
        if not truncated or mode in ("allow", "replay"):
            return self
        errors = [
            _refused_truncation(name, value, bound) for name, (value, bound) in truncated.items()
        ]
        raise ValidationError.from_exception_data("RunSpec", errors)

    @property
    def replay_max_kept(self) -> int | None:
        """The kept-set limit training generation records each token's kept set with
        (`SamplingSettings.replay_max_kept`); None when the run does not replay."""
        replays = self.algorithm.off_policy.truncated_sampling == "replay"
        if replays and self.generation.truncated:
            return self.generation.replay_max_kept
        return None

    @model_validator(mode="after")
    def _version_switch_needs_in_flight_updates(self) -> RunSpec:
        # A response's tokens come from several policy versions only when weights load between
        # decoding steps; without that every token of a response has one version, the switch
        # never fires, and a setting that does nothing would be read as one that works.
        switch = getattr(self.algorithm.estimator, "version_switch", "off")
        if switch == "off" or self.pipeline.in_flight_updates:
            return self
        message = (
            f"algorithm.estimator.version_switch: {switch} acts where a response's tokens were "
            "sampled by several policy versions, which happens only with "
            "pipeline.in_flight_updates: true; set it, or version_switch: off"
        )
        errors = [
            InitErrorDetails(
                type=PydanticCustomError("version_switch", message),
                loc=loc,
                input=value,
            )
            for loc, value in (
                (("algorithm", "estimator", "version_switch"), switch),
                (("pipeline", "in_flight_updates"), False),
            )
        ]
        raise ValidationError.from_exception_data("RunSpec", errors)

    @model_validator(mode="after")
    def _remedy_applies(self, info: ValidationInfo) -> RunSpec:
        # A remedy that would make an invalid spec (a staleness bound under lead_batches, or in
        # a sync run) is refused now, not at the run's first rollback. (`remedied` validates
        # the spec it makes with REMEDIED in the context: that one is not checked again.)
        if not self.stability.enabled or self.stability.action != "rollback":
            return self
        if info.context is not None and info.context.get(REMEDIED):
            return self
        try:
            self.remedied(1)
        except ValidationError as invalid:
            problem = "; ".join(
                f"{'.'.join(str(part) for part in error['loc'])}: {error['msg']}"
                for error in invalid.errors()
            )
            error = InitErrorDetails(
                type=PydanticCustomError(
                    "guard_remedy",
                    "the remedy makes an invalid run spec: {problem}",
                    {"problem": problem},
                ),
                loc=("stability", "remedy"),
                input=self.stability.remedy.model_dump(),
            )
            raise ValidationError.from_exception_data("RunSpec", [error]) from None
        return self

    @property
    def overlaps_publish(self) -> bool:
        """Whether each publish runs beside the next learner step (`pipeline.overlap_publish`
        where it applies: a sync run waits for every version to reach generation). A sharded
        learner gathers before the next step (a collective of the training ranks, ordered with
        the step's own) and puts or broadcasts beside it."""
        pipe = self.pipeline
        return pipe.overlap_publish and pipe.mode == "async"

    def remedied(self, rollbacks: int) -> RunSpec:
        """This spec as it trains after `rollbacks` rollbacks of its stability guard: each one
        scales `learner.lr` by the remedy's `lr_scale` again; the remedy's `max_staleness` (a
        fixed bound, in place of an adaptive one) and `estimator` (whole: its settings, or the
        defaults of a remedy given by name) hold from the first one."""
        remedy = self.stability.remedy
        if rollbacks == 0:
            return self
        data = self.model_dump(mode="json")
        if remedy.lr_scale is not None:
            data["learner"]["lr"] = self.learner.lr * remedy.lr_scale**rollbacks
        if remedy.max_staleness is not None:
            _set_staleness_bound(data, remedy.max_staleness)
        if remedy.estimator is not None:
            # Applied even when the name is the run's: a remedy of `kalman` for a KPO run with
            # q = 0 or no clip is exactly the change of settings it asks for.
            _set_estimator(data, remedy.estimator.model_dump(mode="json"))
        return RunSpec.model_validate(data, context={REMEDIED: True})

    def patched(self, patch: Mapping[str, Any]) -> RunSpec:
        """This spec with a resume's `patch` (spec-shaped, services/spec/stability.py) applied:
        each key it sets replaces the spec's (an estimator whole, with its defaults for what
        it leaves out). Raises `SpecPatchError` naming every key a resume may not change, and
        pydantic's ValidationError (both ValueErrors) for a spec the patch makes invalid."""
        flat = flatten_patch(patch)
        if not flat:
            return self
        data = self.model_dump(mode="json")
        for dotted, value in flat.items():
            if dotted == "pipeline.max_staleness":
                _set_staleness_bound(data, value)
                continue
            if dotted == "algorithm.estimator" and isinstance(value, Mapping):
                _set_estimator(data, value)
                continue
            section, key = dotted.split(".", 1)
            data[section][key] = value
        return RunSpec.model_validate(data)

    @model_validator(mode="after")
    def _minibatches_fit(self) -> RunSpec:
        rows = self.pipeline.batch_groups * self.generation.group_size
        if self.learner.minibatches > rows:
            raise ValueError(
                f"learner.minibatches ({self.learner.minibatches}) exceeds the responses in a "
                f"batch (pipeline.batch_groups x generation.group_size = {rows})"
            )
        return self


def _refused_truncation(name: str, value: float, bound: str) -> InitErrorDetails:
    """The error of a training sampling setting that truncates, under `refuse`."""
    return InitErrorDetails(
        type=PydanticCustomError(
            "truncated_sampling",
            "{value} {bound} truncates training sampling, but the learner's log-probs "
            "are of the full softmax, so every importance ratio is biased (below 1 even "
            "on-policy); sample training rollouts untruncated (top_p 1, top_k 0, min_p 0; "
            "eval.top_p / eval.top_k / eval.min_p truncate evaluation only), or declare it with "
            "algorithm.off_policy.truncated_sampling: allow",
            {"value": value, "bound": bound},
        ),
        loc=("generation", name),
        input=value,
    )


def _set_staleness_bound(data: dict[str, Any], bound: Any) -> None:
    """Make `bound` (an integer, or `{auto: {min, max}}`) the staleness bound of the dumped spec
    `data`, in place of the fixed or adaptive one it has."""
    data["pipeline"]["max_staleness"] = bound
    data["pipeline"]["staleness_auto"] = None


def _set_estimator(data: dict[str, Any], estimator: Mapping[str, Any]) -> None:
    """Make `estimator` the training estimator of the dumped spec `data`; a shadow of the same
    name is dropped (it trains now: its figures are the run's own)."""
    algorithm = data["algorithm"]
    algorithm["estimator"] = dict(estimator)
    name = estimator.get("name")
    algorithm["shadow"] = [shadow for shadow in algorithm.get("shadow", ()) if shadow != name]


__all__ = [
    "MAX_ACTORS",
    "MAX_BATCH_GROUPS",
    "MAX_BUFFER_GROUPS",
    "MAX_CPUS_PER_ACTOR",
    "MAX_CUSTOM_RESOURCES",
    "MAX_CUSTOM_RESOURCE_AMOUNT",
    "MAX_GPUS_PER_ACTOR",
    "MAX_GROUP_SIZE",
    "MAX_LIST_ITEMS",
    "MAX_NAME_CHARS",
    "MAX_PATH_CHARS",
    "MAX_PROMPTS_PER_BATCH",
    "MAX_RESPONSE_TOKENS",
    "MAX_SEED",
    "MAX_STALENESS",
    "MAX_STEPS",
    "MAX_TEMPERATURE",
    "MAX_TEXT_CHARS",
    "MAX_TOKEN_BUDGET",
    "MAX_TOOL_CONCURRENCY",
    "MAX_TOOL_OUTPUT_CHARS",
    "MAX_TOOL_TIMEOUT_S",
    "MAX_TOOL_TURNS",
    "RAY_BUILTIN_RESOURCES",
    "SPEC_PATCH_KEYS",
    "ArithTask",
    "AttnImplementation",
    "BackendName",
    "BackendOption",
    "CustomResources",
    "DatasetTask",
    "EnvVarName",
    "EvalConfig",
    "GenerationConfig",
    "JsonlTask",
    "LearnerConfig",
    "LoraConfig",
    "MlflowTracking",
    "NameItem",
    "NameText",
    "PathText",
    "PipelineConfig",
    "RewardConfig",
    "RunSpec",
    "SandboxUrl",
    "SpecPatchError",
    "StabilityConfig",
    "StabilityObjectives",
    "StabilityRemedy",
    "TaskConfig",
    "TensorboardTracking",
    "ToolsConfig",
    "TrackingConfig",
    "VerifierName",
    "WandbTracking",
    "flatten_patch",
    "merge_patches",
]
