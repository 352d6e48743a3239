"""The generation worker: a thin Ray actor around one generation backend.

It receives prompts, calls the backend, and reports. Weights published by the learner arrive as
an ObjectRef to a state dict (put once into the object store, fetched by every worker); a worker
only records the newest offer and fetches it between batches, at the start of `generate`.

Ray resolves an ObjectRef passed as a top-level argument before the method runs, so offer a ref
wrapped in a list (`offer_weights.remote(version, [ref])`, as `offer_weights_to` does): the worker
then fetches only the newest version, when it next generates. A bare ref also works; Ray then
fetches every offered version on arrival.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeAlias

import ray
import torch

from services.generation.base import SamplingSettings
from services.generation.registry import create_backend
from services.messages import Prompt, Response

StateDict: TypeAlias = Mapping[str, torch.Tensor]
WeightsRef: TypeAlias = "ray.ObjectRef[StateDict]"
# What `offer_weights` accepts: see the module docstring for why a list is preferred.
WeightsOffer: TypeAlias = "WeightsRef | Sequence[WeightsRef] | StateDict"


@dataclass(frozen=True)
class GenerationStats:
    """Counters of one worker since it started. Read by the run driver for metrics."""

    backend: str
    policy_version: int
    batches: int
    tokens_generated: int  # response tokens, EOS included
    last_batch_tokens: int
    last_batch_seconds: float
    last_batch_tokens_per_s: float
    tokens_per_s: float  # all tokens over all time spent in the backend's generate
    weight_swaps: int
    last_swap_seconds: float  # fetch + load of the latest swap


def _unwrap_offer(offer: WeightsOffer) -> WeightsRef | StateDict:
    """The ref or state dict inside an offer (a one-element list holds a ref unresolved)."""
    if isinstance(offer, Sequence) and not isinstance(offer, str | bytes):
        if len(offer) != 1 or not isinstance(offer[0], ray.ObjectRef):
            raise TypeError("a weights offer list must hold exactly one ObjectRef")
        return offer[0]
    return offer


class GenerationWorkerImpl:
    """The worker's logic: one backend (`hf`, `vllm`, ...) and the newest offered weights.

    `GenerationWorker` is this class as a Ray actor class, which is how the pipeline runs it.
    """

    def __init__(self, backend: str, model_path: str, **options: Any) -> None:
        """Construct backend `backend` for `model_path` with its options, inside this actor."""
        self._backend_name = backend
        self._backend = create_backend(backend, model_path, **options)
        self._offer: tuple[int, WeightsRef | StateDict] | None = None
        self._batches = 0
        self._tokens = 0
        self._seconds = 0.0
        self._last_tokens = 0
        self._last_seconds = 0.0
        self._swaps = 0
        self._last_swap_seconds = 0.0

    def offer_weights(self, version: int, weights_ref: WeightsOffer) -> bool:
        """Record weights of `version` for the next batch; False if not newer than what is held.

        Only the newest offer is kept, so older refs are released without ever being fetched.
        """
        newest = self._offer[0] if self._offer is not None else self._backend.policy_version
        if version <= newest:
            return False
        self._offer = (version, _unwrap_offer(weights_ref))
        return True

    def _swap_weights(self) -> None:
        """Load the offered weights if newer than the backend's; called between batches only.

        If fetching or loading fails the error propagates out of `generate` and the offer is kept,
        so the worker never silently generates with weights older than it was offered.
        """
        if self._offer is None:
            return
        version, weights = self._offer
        if version > self._backend.policy_version:
            start = time.perf_counter()
            state_dict = ray.get(weights) if isinstance(weights, ray.ObjectRef) else weights
            self._backend.load_weights(state_dict, version)
            self._swaps += 1
            self._last_swap_seconds = time.perf_counter() - start
        self._offer = None

    def generate(
        self, prompts: list[Prompt], group_size: int, sampling: SamplingSettings
    ) -> list[list[Response]]:
        """Swap to the newest offered weights, then return `group_size` responses per prompt."""
        self._swap_weights()
        start = time.perf_counter()
        groups = self._backend.generate(prompts, group_size, sampling)
        self._last_seconds = time.perf_counter() - start
        self._last_tokens = sum(len(r.response_token_ids) for group in groups for r in group)
        self._batches += 1
        self._tokens += self._last_tokens
        self._seconds += self._last_seconds
        return groups

    def policy_version(self) -> int:
        """Version of the weights the next batch uses if nothing newer is offered before it."""
        return self._backend.policy_version

    def stats(self) -> GenerationStats:
        """Throughput and counters since the worker started."""
        return GenerationStats(
            backend=self._backend_name,
            policy_version=self._backend.policy_version,
            batches=self._batches,
            tokens_generated=self._tokens,
            last_batch_tokens=self._last_tokens,
            last_batch_seconds=self._last_seconds,
            last_batch_tokens_per_s=_rate(self._last_tokens, self._last_seconds),
            tokens_per_s=_rate(self._tokens, self._seconds),
            weight_swaps=self._swaps,
            last_swap_seconds=self._last_swap_seconds,
        )


# Applied as a call, not as a class decorator, so that type checkers see an actor class
# (`.remote`, `.options`) rather than the plain class.
GenerationWorker = ray.remote(GenerationWorkerImpl)


def _rate(tokens: int, seconds: float) -> float:
    """Tokens per second, 0.0 before anything was timed."""
    return tokens / seconds if seconds > 0 else 0.0


def offer_weights_to(
    workers: Sequence[Any], version: int, state_dict: StateDict
) -> tuple[WeightsRef, list[ray.ObjectRef[bool]]]:
    """Put `state_dict` into the object store once and offer it to every worker handle.

    Returns the weights ref and one acknowledgement ref per worker (True where the offer was
    newer than what that worker held). A worker holding the offer keeps the object alive, as long
    as the calling process (its owner) lives.
    """
    weights_ref: WeightsRef = ray.put(dict(state_dict))
    acks: list[ray.ObjectRef[bool]] = [
        worker.offer_weights.remote(version, [weights_ref]) for worker in workers
    ]
    return weights_ref, acks
