"""The interface every generation backend implements."""

from __future__ import annotations

import hashlib
from abc import ABC, abstractmethod
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Literal

import torch

from services.messages import Prompt, Response
from services.weights.base import Channel, StateDictMismatchError, WeightGroup, WeightsManifest

if TYPE_CHECKING:
    from services.tools.config import ToolsConfig
    from services.tools.rollout import ToolRollout
    from services.tools.sandbox import ToolRunner

# "processed": log-probs of the distribution actually sampled from (after temperature, min-p,
# top-k, top-p). This is the behaviour policy the importance ratio must be taken against.
LogprobsMode = Literal["processed"]


@dataclass(frozen=True)
class SamplingSettings:
    """How responses are sampled. Filled from the run config; read by the backend."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = no top-k truncation
    max_new_tokens: int = 256
    seed: int | None = None
    # Keep the tokens whose probability is at least min_p times the most likely token's (0 =
    # off); applied before top-k and top-p, as vLLM's sampler does. (After the older fields:
    # positional construction keeps its meaning.)
    min_p: float = 0.0
    # Record each sampled token's kept set (`Response.kept_ids`), for the learner to replay the
    # truncation; a set larger than this is recorded empty ("over the limit": the learner drops
    # the token). None: nothing recorded.
    replay_max_kept: int | None = None


@dataclass(frozen=True)
class GroupRequest:
    """One prompt to answer `group_size` times, with its own sampling settings (and seed)."""

    prompt: Prompt
    group_size: int
    sampling: SamplingSettings


RefusalReason = Literal["prompt_too_long", "refused"]


@dataclass(frozen=True)
class Refusal:
    """A streamed request the worker did not generate: its prompt is dropped, not retried
    (docs/reliability.md, fault policy). `reason` is what the driver counts it under."""

    prompt_id: str
    reason: RefusalReason
    message: str


@dataclass(frozen=True)
class StreamedGroups:
    """What one `next_groups` call of a generation worker returns: the groups that ended since
    the last call, and the requests it refused meanwhile."""

    groups: list[list[Response]]
    refused: list[Refusal] = field(default_factory=list)


class PromptTooLongError(ValueError):
    """A prompt that leaves no room for a response token in the engine's context."""


def check_prompt_lengths(
    requests: Sequence[GroupRequest], prompt_ids: Sequence[Sequence[int]], context_limit: int
) -> None:
    """Refuse (PromptTooLongError naming the prompt) a prompt of `context_limit` tokens or more:
    the engine could not sample a single token after it. Checked before anything is queued."""
    for request, ids in zip(requests, prompt_ids, strict=True):
        if len(ids) >= context_limit:
            raise PromptTooLongError(
                f"prompt {request.prompt.prompt_id!r} has {len(ids)} tokens; the engine takes "
                f"{context_limit} tokens of prompt and response together"
            )


class GenerationBackend(ABC):
    """Samples groups of responses with behaviour log-probs and swaps weights in place.

    Streaming (what the generation worker drives): `submit` queues groups, every `step` advances
    decoding by one step (admitting queued groups while there is room) and returns the groups
    that ended in it, so a short group comes back while long ones are still decoding. Weights
    may be loaded between two steps (`load_weights`), with responses still in flight: their
    next tokens are sampled by the new version and say so (`Response.token_versions`).
    `generate` is the blocking form: submit, then step until every group has ended.

    One thread drives a backend: nothing here is safe to call from two threads at once (the
    generation worker's engine thread is that one thread).
    """

    logprobs_mode: LogprobsMode = "processed"
    # With weights loaded while responses are in flight: False keeps the KV cache of their
    # earlier tokens (computed by the old weights; the new weights then condition on it, a bias
    # the learner does not see), True recomputes it under the new weights before the next step.
    # Set by the owner (the worker) before any weights are loaded.
    recompute_kv: bool = False
    # Collective weight receiving (the defaults below, for a backend that receives in its own
    # process): the joined group and channel, and weights received but not yet applied.
    _weight_group: WeightGroup | None = None
    _weight_channel: Channel | None = None
    _staged: tuple[WeightsManifest, list[dict[str, torch.Tensor]]] | None = None
    # A version whose load stopped part-way (a failed fetch or receive): the model is a mix of
    # two versions, and `step` refuses to run until a complete version is loaded.
    _torn_version: int | None = None

    @property
    @abstractmethod
    def policy_version(self) -> int:
        """Version of the weights currently loaded."""

    @property
    def torn_version(self) -> int | None:
        """The version only partly loaded, if the last load stopped part-way."""
        return self._torn_version

    # --- streaming ------------------------------------------------------------------------------

    @abstractmethod
    def submit(self, requests: Sequence[GroupRequest]) -> None:
        """Queue groups to generate; each is admitted by a later `step` when there is room.

        Every request is validated first (ValueError naming the prompt), so a bad one queues
        nothing.
        """

    @abstractmethod
    def step(self) -> list[list[Response]]:
        """Advance decoding by one step; return the groups that ended in it (each its G
        responses, in row order). Returns [] when nothing is in flight."""

    @property
    @abstractmethod
    def in_flight(self) -> int:
        """Groups submitted and not yet returned by `step`."""

    def generate(
        self, prompts: list[Prompt], group_size: int, sampling: SamplingSettings
    ) -> list[list[Response]]:
        """Return `group_size` responses for each prompt, in prompt order (blocking).

        Built on `submit` and `step`, on an idle backend. With `sampling.seed` set, group i is
        sampled with `derive_seed(seed, i)`, so the same prompts, group size and settings give
        the same responses, and two groups of one prompt differ.
        """
        validate_sampling(sampling, group_size)
        if not prompts:
            return []
        if self.in_flight:
            raise RuntimeError(
                f"generate needs an idle backend, but {self.in_flight} submitted groups are "
                "in flight: step them to the end first"
            )
        # Each request's prompt id is tagged with its index, so groups of repeated prompts come
        # back in their own places whatever order they end in (and errors still name them).
        requests = group_requests(prompts, group_size, sampling)
        tagged = [
            replace(r, prompt=replace(r.prompt, prompt_id=f"{r.prompt.prompt_id}#{i}"))
            for i, r in enumerate(requests)
        ]
        self.submit(tagged)
        out: list[list[Response] | None] = [None] * len(prompts)
        while self.in_flight:
            for group in self.step():
                index = int(group[0].prompt_id.rpartition("#")[2])
                out[index] = [replace(r, prompt_id=prompts[index].prompt_id) for r in group]
        missing = [prompts[i].prompt_id for i, group in enumerate(out) if group is None]
        if missing:
            raise RuntimeError(f"the backend ended without returning the groups of {missing}")
        return [group for group in out if group is not None]

    # --- multi-turn rollouts ---------------------------------------------------------------------

    def enable_tools(self, settings: ToolsConfig, runner: ToolRunner) -> None:
        """Generate multi-turn responses from now on: decoding stops at a tool call, `runner`
        runs it, its observation is appended and decoding continues (services/tools/rollout.py).

        Called by the owner on an idle backend, before any `submit`. A backend without
        multi-turn support refuses (the default).
        """
        raise NotImplementedError(
            f"the {type(self).__name__} backend does not support tool calls (tools.enabled)"
        )

    def tool_call_counts(self) -> dict[str, int]:
        """Tool calls run since `enable_tools`, by result status (ok, error, timeout, ...)."""
        return {}

    @property
    def tools(self) -> ToolRollout | None:
        """The multi-turn machinery, once `enable_tools` was called (None: single-turn)."""
        return None

    def close(self) -> None:
        """Release what the backend holds: its tool calls and their runner's connections (and
        its engine, where it has one of its own); the backend is unusable afterwards."""
        if self.tools is not None:
            self.tools.close()

    # --- weights --------------------------------------------------------------------------------

    @abstractmethod
    def load_weights(self, state_dict: Mapping[str, torch.Tensor], version: int) -> None:
        """Replace the model weights in place (no rebuild) and record their version."""

    @abstractmethod
    def load_weight_buckets(
        self, buckets: Iterable[Mapping[str, torch.Tensor]], manifest: WeightsManifest
    ) -> None:
        """Load a published version bucket by bucket, in place; the version becomes
        `manifest.version`.

        The manifest is checked against the model before anything is touched
        (StateDictMismatchError), so a mismatched publish changes nothing. May be called
        between two `step`s with groups in flight.
        """

    def weight_receivers(self) -> int:
        """Processes of this backend that join a collective weight group (one by default)."""
        return 1

    def join_weight_group(self, group: WeightGroup, first_rank: int) -> None:
        """Join `group` as rank `first_rank` (blocks until every rank joined).

        A backend joins one group at a time: joining a newer one (a re-formed group) closes the
        channel of the previous one.
        """
        from services.weights.collective import connect

        self.close_weight_group()
        self._weight_channel = connect(group, first_rank)
        self._weight_group = group

    def close_weight_group(self) -> None:
        """Leave the collective weight group, if any (a later `join_weight_group` re-joins)."""
        channel, self._weight_channel, self._weight_group = self._weight_channel, None, None
        if channel is not None:
            channel.close()

    def receive_weights(self, manifest: WeightsManifest, apply: bool) -> None:
        """Receive every bucket of `manifest` from the weight group now (blocking until the
        learner has sent them).

        apply=True loads them into the live model and sets the version; apply=False keeps them
        on the CPU for `apply_staged` (one host copy of the weights), leaving the model as it
        is. If the manifest does not match the model, every bucket is still received (the
        sender and the other receivers must not be left waiting) and then the mismatch raised.
        """
        channel, group = self._weight_channel, self._weight_group
        if channel is None or group is None:
            raise RuntimeError("receive_weights before join_weight_group: no weight group joined")
        buckets = channel.receive(manifest, self.weight_device(group))
        try:
            self.check_weights_manifest(manifest)
        except StateDictMismatchError:
            for _ in buckets:  # drain the broadcast, then fail
                pass
            raise
        if apply:
            self.load_weight_buckets(buckets, manifest)
            self._staged = None  # anything staged earlier is older than what is now loaded
        else:
            # Clones: a received bucket may be a view of a buffer the channel reuses.
            staged = [{name: t.to("cpu", copy=True) for name, t in b.items()} for b in buckets]
            self._staged = (manifest, staged)

    @property
    def staged_version(self) -> int | None:
        """Version of the weights received with apply=False and not yet applied, if any."""
        return None if self._staged is None else self._staged[0].version

    def apply_staged(self) -> None:
        """Load the weights staged by `receive_weights(apply=False)` and set their version."""
        if self._staged is None:
            raise RuntimeError("apply_staged: no weights were staged by receive_weights")
        manifest, buckets = self._staged
        self.load_weight_buckets(buckets, manifest)
        self._staged = None

    def weight_device(self, group: WeightGroup) -> torch.device:
        """Where received buckets land: CPU for gloo, the current CUDA device for NCCL (and for
        ipc where there is one: a CUDA IPC handle maps there without a copy)."""
        if group.backend == "gloo" or (group.backend == "ipc" and not torch.cuda.is_available()):
            return torch.device("cpu")
        return torch.device("cuda", torch.cuda.current_device())

    def check_weights_manifest(self, manifest: WeightsManifest) -> None:
        """Raise StateDictMismatchError if `manifest` does not fit the model (names, shapes).

        The default accepts anything (the load itself then checks); backends that can check
        without loading override it, so a collective receive fails before staging.
        """
        return None


def validate_sampling(sampling: SamplingSettings, group_size: int) -> None:
    """Raise ValueError for settings that do not describe a sampling distribution."""
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1, got {group_size}")
    if sampling.temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {sampling.temperature}")
    if not 0 < sampling.top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {sampling.top_p}")
    if sampling.top_k < 0:
        raise ValueError(f"top_k must be >= 0 (0 = off), got {sampling.top_k}")
    if not 0 <= sampling.min_p <= 1:
        raise ValueError(f"min_p must be in [0, 1] (0 = off), got {sampling.min_p}")
    if sampling.replay_max_kept is not None and sampling.replay_max_kept < 1:
        raise ValueError(f"replay_max_kept must be >= 1 (or None), got {sampling.replay_max_kept}")
    if sampling.max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {sampling.max_new_tokens}")


def validate_requests(requests: Sequence[GroupRequest]) -> None:
    """Raise ValueError naming the prompt of the first request whose settings are invalid."""
    for request in requests:
        try:
            validate_sampling(request.sampling, request.group_size)
        except ValueError as error:
            raise ValueError(f"request for prompt {request.prompt.prompt_id!r}: {error}") from None


def encode_prompts(
    tokenizer: Any, prompts: Sequence[Prompt], tools: list[dict[str, Any]] | None = None
) -> list[list[int]]:
    """Token ids of each prompt (no padding): its text with the tokenizer's default encoding,
    or, for a chat (`Prompt.messages`), the tokenizer's chat template with the generation
    prompt added (and `tools` declared to it, if any, for a prompt that takes tools).

    Every backend encodes through this function, so all of them see the same prompt ids.
    """
    encoded: list[list[int]] = [[] for _ in prompts]
    plain = [index for index, prompt in enumerate(prompts) if not prompt.messages]
    if plain:
        texts = [prompts[index].text for index in plain]
        for index, ids in zip(plain, tokenizer(texts)["input_ids"], strict=True):
            encoded[index] = list(ids)
    for index, prompt in enumerate(prompts):
        if prompt.messages:
            encoded[index] = render_chat(tokenizer, prompt, tools if prompt.takes_tools else None)
    for prompt, ids in zip(prompts, encoded, strict=True):
        if not ids:
            raise ValueError(f"prompt {prompt.prompt_id!r} encodes to no tokens")
    return encoded


def render_chat(
    tokenizer: Any, prompt: Prompt, tools: list[dict[str, Any]] | None = None
) -> list[int]:
    """The token ids of `prompt.messages` through the tokenizer's chat template, ready for the
    assistant's answer, with `tools` declared to the template if any; ValueError when the
    tokenizer has no template."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            f"prompt {prompt.prompt_id!r} is a chat, but the model's tokenizer has no chat "
            "template (set one in its tokenizer_config.json, or give prompts as strings)"
        )
    extra = {"tools": tools} if tools else {}
    rendered = tokenizer.apply_chat_template(
        prompt.messages, add_generation_prompt=True, tokenize=True, return_dict=True, **extra
    )
    return [int(token) for token in rendered["input_ids"]]


def derive_seed(seed: int, index: int) -> int:
    """The seed of group `index` of a call seeded with `seed` (a 63-bit hash of both).

    Hashing, rather than `seed + index`, keeps the groups of two calls with nearby seeds
    from sharing streams.
    """
    digest = hashlib.blake2b(f"{seed}:{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") >> 1


def group_requests(
    prompts: Sequence[Prompt], group_size: int, sampling: SamplingSettings
) -> list[GroupRequest]:
    """One request per prompt; with a seed, group i gets `derive_seed(seed, i)`."""
    return [
        GroupRequest(
            prompt,
            group_size,
            sampling
            if sampling.seed is None
            else replace(sampling, seed=derive_seed(sampling.seed, i)),
        )
        for i, prompt in enumerate(prompts)
    ]
