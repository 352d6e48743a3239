"""The learner actor: a thin Ray shell around `LearnerCore`.

It receives batches of scored groups, calls the core, and reports the metrics record together
with the newly published weights. Call `step` with `.options(num_returns=2)`: the metrics and the
state dict then come back as two refs, and the driver can offer the weights ref to every
generation worker without fetching it (it is put into the object store once, owned by the
caller of `step`).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import ray
import torch
from torch import Tensor

from kpo_core.config import AlgorithmConfig, LearnerConfig, RunSpec
from services.learner.step import LearnerCore
from services.messages import ScoredGroup


class LearnerImpl:
    """The learner's actor logic. `Learner` is this class as a Ray actor class."""

    def __init__(
        self,
        model_path: str,
        learner: LearnerConfig,
        algorithm: AlgorithmConfig,
        temperature: float,
        seed: int,
        ratio_dir: str | None = None,
    ) -> None:
        """Seed torch, use one torch thread per reserved CPU, and build the core."""
        torch.manual_seed(seed)
        threads = max(1, int(learner.num_cpus))
        self._core = LearnerCore(
            model_path, learner, algorithm, temperature, seed, threads, ratio_dir
        )

    def version(self) -> int:
        """Policy version of the current weights (completed steps)."""
        return self._core.version

    def pid(self) -> int:
        """Process id of the actor (for tests and for killing a stuck learner)."""
        return os.getpid()

    def initial_weights(self) -> dict[str, Tensor]:
        """The weights before any step (version 0, or the version loaded from a checkpoint)."""
        return self._core.state_dict_for_publish()

    def step(self, groups: list[ScoredGroup]) -> tuple[dict[str, float], dict[str, Tensor]]:
        """One learner step: (metrics record, weights of the new version)."""
        metrics = self._core.train_step(groups)
        return metrics, self._core.state_dict_for_publish()

    def save_checkpoint(self, path: str) -> str:
        """Write a checkpoint directory at `path` (on the actor's machine); return its path."""
        return str(self._core.save_checkpoint(path))

    def load_checkpoint(self, path: str) -> int:
        """Restore a checkpoint written by `save_checkpoint`; return its version."""
        return self._core.load_checkpoint(Path(path))


# Applied as a call, not as a class decorator, so that type checkers see an actor class
# (`.remote`, `.options`) rather than the plain class.
Learner = ray.remote(LearnerImpl)


def start_learner(spec: RunSpec, model_path: str, ratio_dir: str | None = None) -> Any:
    """Start the learner actor of `spec` with its CPU/GPU reservation; return the handle.

    `ratio_dir` (on the learner's machine) receives `learner.record_ratios_every`'s files.
    """
    return Learner.options(num_cpus=spec.learner.num_cpus, num_gpus=spec.learner.num_gpus).remote(
        model_path, spec.learner, spec.algorithm, spec.generation.temperature, spec.seed, ratio_dir
    )
