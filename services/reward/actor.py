"""`VerifierActor`: the Ray actor that scores groups with one verifier. Thin on purpose.

It receives groups, calls `scoring.score_groups` with its long-lived worker pool, and keeps
running counts for `stats()`. All scoring logic lives in `scoring`, testable without Ray.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping, Sequence
from typing import Any, cast

import ray
from ray.actor import ActorHandle

from services.messages import Prompt, Response, ScoredGroup
from services.reward.base import VerifierConfig
from services.reward.registry import build_verifier
from services.reward.scoring import count_outcomes, make_pool, score_groups


class VerifierActor:
    """Scores groups of responses with verifier `verifier` (a registered name) and `config`.

    `plugin_modules` are imported first, so that verifiers they register (custom tasks, tests)
    can be named: the actor runs in its own process, which knows only what it has imported.
    `num_workers` is the number of worker processes checking in parallel.
    """

    def __init__(
        self,
        verifier: str,
        config: VerifierConfig | Mapping[str, Any] | None = None,
        *,
        num_workers: int = 1,
        plugin_modules: Sequence[str] = (),
    ) -> None:
        for module in plugin_modules:
            importlib.import_module(module)
        self._verifier = build_verifier(verifier, config)
        self._pool = make_pool(self._verifier, num_workers)
        self._counts = count_outcomes([])

    def score(self, groups: list[tuple[Prompt, list[Response]]]) -> list[ScoredGroup]:
        """Score every response of every group; groups come back in the same order."""
        scored = score_groups(self._verifier, groups, pool=self._pool)
        batch = count_outcomes(r for group in scored for r in group.responses)
        for key, value in batch.items():
            self._counts[key] += value
        return scored

    def stats(self) -> dict[str, int]:
        """Running counts: scored, correct, timeouts, errors, and worker_restarts."""
        return {**self._counts, "worker_restarts": self._pool.restarts}

    def close(self) -> None:
        """Stop the worker processes (also done when Ray shuts the actor down gracefully)."""
        self._pool.close()

    def __ray_shutdown__(self) -> None:
        self.close()


def start_verifier_actor(
    verifier: str,
    config: VerifierConfig | Mapping[str, Any] | None = None,
    *,
    num_workers: int = 1,
    plugin_modules: Sequence[str] = (),
    num_cpus: float | None = None,
) -> ActorHandle[VerifierActor]:
    """Start a `VerifierActor` in the connected Ray cluster and return its handle.

    It reserves `num_cpus` (default: one per worker process, the ones that do the work).
    """
    remote_cls = ray.remote(VerifierActor)
    handle = remote_cls.options(num_cpus=num_workers if num_cpus is None else num_cpus).remote(
        verifier, config, num_workers=num_workers, plugin_modules=tuple(plugin_modules)
    )
    # Ray types `.remote()` as "handle or class" so that method calls type-check; it is a handle.
    return cast(ActorHandle[VerifierActor], handle)
