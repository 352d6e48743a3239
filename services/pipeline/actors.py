"""Starting the Ray actors of a run from its spec, by Ray resources.

CPUs and GPUs per actor come from the spec, so the same spec places generation and the learner
on GPUs of a cluster or on CPU cores here. Ray gives each actor OMP_NUM_THREADS equal to its CPU
reservation, which is what keeps actors sharing a small machine from fighting over cores.
"""

from __future__ import annotations

import copy
import logging
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import ray

from services.generation.worker import GenerationWorker
from services.learner.group import LearnerGroup, wait_all
from services.local_ray import NO_METRICS_EXPORTERS
from services.reward.actor import start_verifier_actor
from services.spec import RunSpec

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ResourceNeeds:
    cpus: float
    gpus: float
    custom: dict[str, float]


def resource_needs(spec: RunSpec) -> ResourceNeeds:
    """CPUs, GPUs and custom resources the run's actors reserve in total, at most: an elastic
    pool counts as its `generation.actors.max` workers, the most it may grow to."""
    gen, reward, learner = spec.generation, spec.reward, spec.learner
    # A standby worker holds a model like a serving one, so it reserves what one reserves; an
    # elastic pool reserves its largest size.
    ranks, workers = learner.world_size, gen.max_workers + gen.standby
    custom: dict[str, float] = {}
    for count, resources in ((workers, gen.resources), (ranks, learner.resources)):
        for name, amount in resources.items():
            custom[name] = custom.get(name, 0.0) + count * amount
    return ResourceNeeds(
        cpus=workers * gen.num_cpus
        + reward.num_workers * reward.num_cpus
        + ranks * learner.num_cpus,
        gpus=workers * gen.num_gpus + ranks * learner.num_gpus,
        custom=custom,
    )


# Progress bars of model loading and saving, from every actor, would drown the step lines. And no
# actor downloads anything: the driver resolves the model (and datasets) to local files before any
# actor starts, so the hub is off in the actors, where a download could only be unplanned code
# (transformers fetches attention kernels from the hub when a kernel package is missing).
ACTOR_ENV = {
    "HF_HUB_OFFLINE": "1",
    "HF_HUB_DISABLE_PROGRESS_BARS": "1",
    "TRANSFORMERS_VERBOSITY": "error",
    "TOKENIZERS_PARALLELISM": "false",
}


def connect_ray(spec: RunSpec) -> None:
    """Join the cluster at RAY_ADDRESS, or start a local instance large enough for the run.

    A local instance gets at least the machine's cores and at least what the actors reserve, so
    a spec asking for more CPUs than the machine has runs (oversubscribed) instead of waiting
    forever for resources that never come.
    """
    if ray.is_initialized():
        return
    # In a Ray job, Ray's job supervisor sets it to the cluster the job runs on. Empty counts
    # as unset, as for the launcher (services.jobs.settings); read here, not through the control
    # plane's settings, which the run's driver has no business importing.
    address = os.environ.get("RAY_ADDRESS") or None
    if address:
        ray.init(address=address, runtime_env={"env_vars": ACTOR_ENV})
        return
    # What ray.init starts (the GCS, the raylet, their agents) inherits this environment.
    # Ray's ports other than its exporters bind every interface, as for `kpo serve`'s head
    # (services/jobs/ray_head.py): they run in token mode, Ray's default for a new local
    # instance (its token in ~/.ray/auth_token, made if missing), which an inherited
    # RAY_AUTH_MODE=disabled would turn off.
    os.environ.update(NO_METRICS_EXPORTERS)
    if os.environ.get("RAY_AUTH_MODE", "token").lower() != "token":
        log.warning(
            "RAY_AUTH_MODE=%s ignored: a local Ray instance runs in token mode",
            os.environ["RAY_AUTH_MODE"],
        )
        del os.environ["RAY_AUTH_MODE"]
    needs = resource_needs(spec)
    cpus = max(os.cpu_count() or 1, math.ceil(needs.cpus))
    ray.init(
        num_cpus=cpus,
        num_gpus=math.ceil(needs.gpus),
        # A local instance stands for every node group at once: it has what the run asks for.
        resources={name: float(math.ceil(amount)) for name, amount in needs.custom.items()},
        include_dashboard=False,
        runtime_env={"env_vars": ACTOR_ENV},
    )


def check_cluster_resources(spec: RunSpec) -> None:
    """Fail with a clear message when the cluster can never hold the run's actors."""
    needs = resource_needs(spec)
    total: dict[str, float] = ray.cluster_resources()  # type: ignore[no-untyped-call]
    for name, wanted in (("CPU", needs.cpus), ("GPU", needs.gpus), *needs.custom.items()):
        have = float(total.get(name, 0.0))
        if wanted > have:
            # An autoscaling cluster may grow into it, so this is a warning, not a refusal.
            log.warning(
                "the run reserves %.2f %s%s but the cluster has %.2f now (an autoscaling "
                "cluster may grow into it)",
                wanted,
                name,
                "" if spec.generation.actors is None else " at its elastic pool's max",
                have,
            )


@dataclass
class RunActors:
    """Handles of a run's actors. `standby`: generation workers that hold the model and every
    published version but take no prompts, each ready to take a lost worker's place."""

    generation: list[Any]
    verifiers: list[Any]
    learner: LearnerGroup
    standby: list[Any] = field(default_factory=list)

    def all(self) -> list[Any]:
        """Every actor handle (the learner's ranks included)."""
        return [*self.generation, *self.standby, *self.verifiers, *self.learner.ranks]

    def pids(self) -> dict[str, list[int]]:
        """Process ids, by role (for operators, and for tests that kill one)."""

        def pid_of(handles: list[Any]) -> list[int]:
            return ray.get([h.__ray_call__.remote(lambda _self: os.getpid()) for h in handles])

        return {
            "generation": pid_of(self.generation),
            "standby": pid_of(self.standby),
            "verifiers": pid_of(self.verifiers),
            "learner": self.learner.pids(),
        }

    def kill(self) -> None:
        """Stop every actor now (no restart), the learner group's placement with it."""
        for handle in [*self.generation, *self.standby, *self.verifiers]:
            try:
                ray.kill(handle, no_restart=True)
            except Exception as error:  # an actor that is already gone is what we want
                log.debug("kill %s: %s", handle, error)
        self.learner.kill()


# Keyword arguments of a generation worker that `generation.options` may not set: the worker's
# own (from `pipeline`) and the one `generation.engine` becomes.
# The key to set instead of each.
_RESERVED_OPTIONS = {
    "in_flight_updates": "pipeline.in_flight_updates",
    "recompute_kv": "pipeline.recompute_kv",
    "engine_kwargs": "generation.engine",
    "load_when_idle": "generation.standby",
}


@dataclass(frozen=True)
class GenerationWorkerArgs:
    """What one generation actor is started with: Ray's actor options, then the constructor's
    arguments (`GenerationWorker(backend, model_path, **worker_options)`)."""

    actor_options: dict[str, Any]
    backend: str
    model_path: str
    worker_options: dict[str, Any]


def generation_worker_args(spec: RunSpec, model_dir: Path) -> GenerationWorkerArgs:
    """The arguments of a generation actor for `spec`.

    `generation.options` become the backend's keyword arguments; `generation.engine` (vLLM
    engine arguments, nested mappings included) goes to the vLLM backend whole, as its
    `engine_kwargs`, which it hands to the engine unchanged: only scalars fit the backend's own
    keyword arguments, and anything else there was a TypeError at start-up.
    """
    gen = spec.generation
    for key, instead in _RESERVED_OPTIONS.items():
        if key in gen.options:
            raise ValueError(f"generation.options.{key} is not a backend option: set {instead}")
    backend_options: dict[str, Any] = dict(gen.options)
    if gen.engine:
        # A copy: the actor gets its own, whatever the engine does with the mapping.
        backend_options["engine_kwargs"] = copy.deepcopy(gen.engine)
    return GenerationWorkerArgs(
        actor_options={
            "num_cpus": gen.num_cpus,
            "num_gpus": gen.num_gpus,
            "resources": dict(gen.resources),
        },
        backend=gen.backend,
        model_path=str(model_dir),
        worker_options={
            "in_flight_updates": spec.pipeline.in_flight_updates,
            "recompute_kv": spec.pipeline.recompute_kv,
            **tool_options(spec),
            **backend_options,
        },
    )


def tool_options(spec: RunSpec) -> dict[str, Any]:
    """The worker's `tools` arguments when `tools.enabled` (else none): the spec's section as
    is (the sandbox token stays in the worker's environment, named by `sandbox_token_env`), and
    the actor reaps what its local sandbox's calls leave (its process is Ray's, nothing else's)."""
    return {"tools": spec.tools, "reap_call_orphans": True} if spec.tools.enabled else {}


def start_generation_worker(spec: RunSpec, model_dir: Path, standby: bool = False) -> Any:
    """One generation actor (not waited for: its first call waits for the constructor).

    `standby`: a warm standby, which loads each offer as soon as it gets it (`load_when_idle`):
    it holds no work, yet must hold the newest version when it takes a lost worker's place. It
    keeps doing so once promoted, which only loads sooner what a serving worker loads anyway."""
    args = generation_worker_args(spec, model_dir)
    options = {**args.worker_options, "load_when_idle": True} if standby else args.worker_options
    return GenerationWorker.options(**args.actor_options).remote(
        args.backend, args.model_path, **options
    )


def start_verifier(spec: RunSpec) -> Any:
    """One verifier actor (not waited for)."""
    reward = spec.reward
    return start_verifier_actor(
        reward.verifier,
        {"timeout_s": reward.timeout_s, "format_reward": reward.format_reward},
        num_workers=reward.processes_per_worker,
        num_cpus=reward.num_cpus,
    )


def start_actors(spec: RunSpec, model_dir: Path, ratio_dir: Path | None = None) -> RunActors:
    """Start generation workers, verifier actors and the learner group; wait until all are up.

    `ratio_dir`: where the learner saves log-ratios when `learner.record_ratios_every` is set.
    """
    actors = RunActors(
        generation=[
            start_generation_worker(spec, model_dir) for _ in range(spec.generation.num_workers)
        ],
        verifiers=[start_verifier(spec) for _ in range(spec.reward.num_workers)],
        learner=LearnerGroup(spec, str(model_dir), None if ratio_dir is None else str(ratio_dir)),
        standby=[
            start_generation_worker(spec, model_dir, standby=True)
            for _ in range(spec.generation.standby)
        ],
    )
    try:
        # A constructor that fails (bad model, bad backend option) surfaces here, before any work.
        others = [*actors.generation, *actors.standby, *actors.verifiers]
        wait_all(
            [*(h.__ray_call__.remote(lambda _self: None) for h in others), *actors.learner.setup()]
        )
    except BaseException:
        actors.kill()  # a cancel or a failure while starting leaves no actor behind
        raise
    return actors
