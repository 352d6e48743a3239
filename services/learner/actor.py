"""A learner rank: a thin Ray shell around `LearnerCore`.

It joins its group's process group, builds its core, and then receives the same calls as every
other rank of the group (`services.learner.group.LearnerGroup` fans them out). Call `step` with
`.options(num_returns=2)`: the metrics and the state dict then come back as two refs, and the
driver can offer rank 0's weights ref to every generation worker without fetching it (it is put
into the object store once, owned by the caller of `step`). Ranks other than 0 return an empty
record and no weights.
"""

from __future__ import annotations

import os
from pathlib import Path

import ray
import torch
from torch import Tensor

from kpo_core.config import AlgorithmConfig, LearnerConfig
from services.learner.distributed import RankGroup, rendezvous_address
from services.learner.export import export_model
from services.learner.step import LearnerCore
from services.messages import ScoredGroup

# A rank that waits this long for the others in a collective gives up (the driver notices a
# dead rank at once and stops the group; this bounds what a lost network would cost).
COLLECTIVE_TIMEOUT_S = 1800.0


class LearnerImpl:
    """One rank's actor logic. `Learner` is this class as a Ray actor class."""

    def __init__(
        self,
        model_path: str,
        learner: LearnerConfig,
        algorithm: AlgorithmConfig,
        temperature: float,
        seed: int,
        rank: int = 0,
        ratio_dir: str | None = None,
    ) -> None:
        """Remember the settings; `setup` joins the group and loads the model."""
        torch.manual_seed(seed)
        self._args = (model_path, learner, algorithm, temperature, seed, ratio_dir)
        self._group = RankGroup(rank, learner.world_size)
        self._core: LearnerCore | None = None

    def rendezvous_address(self) -> str:
        """Where the group meets (asked of rank 0)."""
        return rendezvous_address()

    def setup(self, address: str) -> None:
        """Join the process group at `address` and build the core (a collective under fsdp2)."""
        model_path, learner, algorithm, temperature, seed, ratio_dir = self._args
        threads = max(1, int(learner.num_cpus))
        torch.set_num_threads(threads)
        device = torch.device("cuda" if learner.device.startswith("cuda") else "cpu")
        self._group.join(address, device, COLLECTIVE_TIMEOUT_S)
        self._core = LearnerCore(
            model_path, learner, algorithm, temperature, seed, None, ratio_dir, self._group
        )

    @property
    def core(self) -> LearnerCore:
        if self._core is None:
            raise RuntimeError("the learner rank is not set up: call setup first")
        return self._core

    def version(self) -> int:
        """Policy version of the current weights (completed steps)."""
        return self.core.version

    def pid(self) -> int:
        """Process id of the actor (for tests and for killing a stuck learner)."""
        return os.getpid()

    def initial_weights(self) -> dict[str, Tensor]:
        """The weights before any step (version 0, or the version loaded from a checkpoint)."""
        return self.core.state_dict_for_publish()

    def step(self, groups: list[ScoredGroup]) -> tuple[dict[str, float], dict[str, Tensor]]:
        """One learner step: (metrics record, weights of the new version); rank 0's only."""
        metrics = self.core.train_step(groups)
        weights = self.core.state_dict_for_publish()
        if self._group.rank != 0:
            return {}, {}
        return metrics, weights

    def save_checkpoint(self, path: str) -> str:
        """Write this rank's part of the checkpoint directory at `path`; return its path."""
        return str(self.core.save_checkpoint(path))

    def load_checkpoint(self, path: str) -> int:
        """Restore a checkpoint written by `save_checkpoint`; return its version."""
        return self.core.load_checkpoint(Path(path))

    def export(self, learner_dir: str, out_dir: str) -> str:
        """Write the Hugging Face model of a checkpoint to `out_dir` (run on rank 0 alone: it
        reads the checkpoint from disk, whatever the group's sharding)."""
        return str(export_model(Path(learner_dir), Path(out_dir)))


# Applied as a call, not as a class decorator, so that type checkers see an actor class
# (`.remote`, `.options`) rather than the plain class.
Learner = ray.remote(LearnerImpl)
