"""The `hf` generation backend: transformers on CPU or GPU, with our own sampling loop.

`model.generate` is deliberately not used: the learner's importance ratios are taken against the
behaviour log-probs, so the distribution each token is sampled from, and the log-prob reported
for it, must be exactly the ones computed here (see `hf_sampling.processed_logprobs`).

Generation is continuous batching (`hf_engine.ContinuousBatcher`): `submit` queues groups,
`step` decodes one token for every running row and admits queued groups, and groups come back as
soon as their G rows end. Weights may be loaded between two steps with rows in flight; their
next tokens are then sampled (and their behaviour log-probs computed) by the new weights, over a
KV cache that the old weights computed, unless `recompute_kv` is set.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    DynamicCache,
    PreTrainedModel,
)

from services.generation.base import (
    GenerationBackend,
    GroupRequest,
    encode_prompts,
    validate_sampling,
)
from services.generation.hf_batch import left_pad, new_cache
from services.generation.hf_engine import ContinuousBatcher, NonFiniteLogitsError
from services.generation.hf_sampling import processed_logprobs
from services.messages import Prompt, Response
from services.model_layout import check_causal_lm
from services.tools.config import ToolsConfig
from services.tools.rollout import ToolRollout
from services.tools.sandbox import ToolRunner
from services.weights.base import StateDictMismatchError, WeightsManifest
from services.weights.loading import check_manifest, load_buckets_into, module_shapes
from services.weights.matching import shapes_of, tied_groups, weights_mismatch


def check_state_dict(model: torch.nn.Module, state_dict: Mapping[str, torch.Tensor]) -> None:
    """Raise StateDictMismatchError naming missing, unexpected and wrongly shaped keys, and
    keys whose dtype a copy cannot cast to the model's (services.weights.matching).

    A key may be absent when another key of the same tied tensor (e.g. `lm_head.weight` tied
    to the input embedding) is present, since loading either fills both.
    """
    expected = model.state_dict()
    problem = weights_mismatch(
        shapes_of(expected), shapes_of(state_dict), tied=tied_groups(expected)
    )
    if problem:
        raise StateDictMismatchError(f"state dict does not match the model: {problem}")


def _resolve_dtype(dtype: torch.dtype | str) -> torch.dtype:
    """Accept a torch dtype or its name ("float32", "bfloat16", ...)."""
    resolved = getattr(torch, dtype, None) if isinstance(dtype, str) else dtype
    if not isinstance(resolved, torch.dtype):
        raise ValueError(f"unknown dtype {dtype!r}")
    return resolved


class HFBackend(GenerationBackend):
    """Generation with a transformers causal LM loaded from a local model directory.

    Behaviour log-probs (`logprobs_mode = "processed"`): each is the log-prob of the sampled token
    under the distribution it was actually drawn from, i.e. after temperature scaling (the
    temperature IS applied) and min-p / top-k / top-p truncation, renormalised over the kept
    tokens (whose ids a request may ask to record: `SamplingSettings.replay_max_kept`).
    Untruncated at temperature 1 that equals the model's plain log-softmax, which is
    what a learner recomputes. With temperature 0 decoding is greedy and every log-prob is 0.0
    (a point mass on the arg-max token).
    """

    def __init__(
        self,
        model_path: str | Path,
        *,
        device: str | torch.device = "cpu",
        dtype: torch.dtype | str = torch.float32,
        attn_implementation: str | None = None,
        max_batch_rows: int | None = None,
        recompute_kv: bool = False,
    ) -> None:
        """Load model and tokenizer from `model_path`; weights start as policy version 0.

        `max_batch_rows` caps the rows decoded together (None: every submitted group is admitted
        at the next step); `recompute_kv` recomputes the KV cache of rows in flight when new
        weights are loaded (see `GenerationBackend.recompute_kv`).
        """
        self._device = torch.device(device)
        # Before the weights: a family whose cache the engine cannot batch is refused by name.
        layout = check_causal_lm(AutoConfig.from_pretrained(str(model_path)), str(model_path))
        # Default: SDPA, or eager for a family SDPA cannot run as it trains (as the learner).
        attention = attn_implementation or layout.attention_for("sdpa")
        model: PreTrainedModel = AutoModelForCausalLM.from_pretrained(
            str(model_path), dtype=_resolve_dtype(dtype), attn_implementation=attention
        )
        # transformers declares `to` through functools.wraps(nn.Module.to), which mypy reads as
        # the unbound function.
        self._model: PreTrainedModel = model.to(self._device).eval()  # type: ignore[arg-type]
        self._tokenizer = AutoTokenizer.from_pretrained(str(model_path))
        self._eos_ids = self._find_eos_ids()
        pad_id = self._tokenizer.pad_token_id
        self._pad_id = int(pad_id if pad_id is not None else (self._eos_ids or [0])[0])
        # transformers 5 renamed the forward's `past_key_values` argument to `cache`; use the
        # name this version's model declares.
        forward_args = inspect.signature(self._model.forward).parameters
        self._cache_arg = "cache" if "cache" in forward_args else "past_key_values"
        self._version = 0
        self._torn_version: int | None = None
        self._shapes = module_shapes(self._model)
        self.recompute_kv = recompute_kv
        self._max_batch_rows = max_batch_rows
        self._tools: ToolRollout | None = None
        self._engine = self._new_engine()

    def _new_engine(self) -> ContinuousBatcher:
        return ContinuousBatcher(
            forward=self._forward,
            new_cache=lambda: new_cache(self._model.config),
            encode=lambda requests: self.encode([r.prompt for r in requests]),
            decode=lambda rows: list(self._tokenizer.batch_decode(rows, skip_special_tokens=True)),
            eos_ids=self._eos_ids,
            pad_id=self._pad_id,
            device=self._device,
            max_rows=self._max_batch_rows,
            tools=self._tools,
            decode_text=lambda ids: str(
                self._tokenizer.decode(list(ids), skip_special_tokens=False)
            ),
            context_limit=self.context_length,
        )

    @property
    def context_length(self) -> int:
        """Longest prompt + response the model takes (its position embeddings' length)."""
        return int(getattr(self._model.config, "max_position_embeddings", 2**31 - 1))

    def enable_tools(self, settings: ToolsConfig, runner: ToolRunner) -> None:
        """Multi-turn rollouts from now on (see `GenerationBackend.enable_tools`)."""
        if self._engine.in_flight:
            raise RuntimeError("enable_tools needs an idle backend")
        if self._tools is not None:
            self._tools.close()
        self._tools = ToolRollout(settings, runner, self._tokenizer)
        self._engine = self._new_engine()

    def tool_call_counts(self) -> dict[str, int]:
        """Tool calls run since `enable_tools`, by result status."""
        return self._tools.calls.counts() if self._tools is not None else {}

    @property
    def tools(self) -> ToolRollout | None:
        """The multi-turn machinery, once `enable_tools` was called."""
        return self._tools

    @property
    def policy_version(self) -> int:
        """Version of the weights currently loaded (0 for the weights loaded from disk)."""
        return self._version

    @property
    def model(self) -> PreTrainedModel:
        """The live model (read it, do not replace it: `load_weights` updates it in place)."""
        return self._model

    @property
    def tokenizer(self) -> Any:
        """The tokenizer used to encode prompts and decode responses."""
        return self._tokenizer

    def _find_eos_ids(self) -> list[int]:
        """Stop tokens: the tokenizer's EOS plus those of the model's generation config."""
        ids: set[int] = set()
        config_eos = getattr(self._model.generation_config, "eos_token_id", None)
        for candidate in (self._tokenizer.eos_token_id, config_eos):
            if isinstance(candidate, int):
                ids.add(candidate)
            elif isinstance(candidate, list | tuple):
                ids.update(int(token) for token in candidate)
        return sorted(ids)

    def encode(self, prompts: Sequence[Prompt]) -> list[list[int]]:
        """Token ids of each prompt text, as the model is conditioned on them (no padding);
        chat prompts declare the tool when tool calls are Hermes-style."""
        tools = self._tools.encoder.prompt_tools() if self._tools is not None else None
        return encode_prompts(self._tokenizer, prompts, tools)

    # --- streaming ------------------------------------------------------------------------------

    def submit(self, requests: Sequence[GroupRequest]) -> None:
        """Queue groups; each is admitted (prefilled into the running batch) by a later step."""
        self._engine.submit(requests)

    def step(self) -> list[list[Response]]:
        """Decode one token for every running row, admitting queued groups; return the groups
        that ended. Refuses to run on partly loaded weights (see `load_weight_buckets`)."""
        if self._torn_version is not None:
            raise RuntimeError(
                f"weights of version {self._torn_version} were only partly loaded; load a "
                "complete version before generating"
            )
        return self._engine.step(self._version)

    @property
    def in_flight(self) -> int:
        """Groups submitted and not yet returned."""
        return self._engine.in_flight

    @property
    def running_rows(self) -> int:
        """Rows decoding now (at most `max_batch_rows`, unless one group is larger)."""
        return self._engine.running_rows

    def _forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        position_ids: torch.Tensor,
        cache: DynamicCache,
    ) -> torch.Tensor:
        """Next-token logits (B, V) for the last input position, extending `cache` in place."""
        output = self._model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            use_cache=True,
            logits_to_keep=1,
            **{self._cache_arg: cache},
        )
        logits: torch.Tensor = output.logits[:, -1, :]
        return logits

    # --- weights --------------------------------------------------------------------------------

    def load_weights(self, state_dict: Mapping[str, torch.Tensor], version: int) -> None:
        """Copy `state_dict` into the live model's parameters in place and set the version.

        Keys and shapes are checked first (StateDictMismatchError), so a bad state dict leaves
        the model and its version untouched. Tensors may be on any device or dtype: they are
        copied into the existing parameters, which keep theirs. Rows in flight continue with
        the new weights from the next step.
        """
        check_state_dict(self._model, state_dict)
        with torch.no_grad():
            # Keys were checked above; strict=False only lets a tied alias be absent.
            self._model.load_state_dict(dict(state_dict), strict=False)
        self._loaded(int(version))

    def load_weight_buckets(
        self, buckets: Iterable[Mapping[str, torch.Tensor]], manifest: WeightsManifest
    ) -> None:
        """Load a published version bucket by bucket, in place, and set its version.

        The manifest is checked first, so a mismatched one changes nothing. A failure after
        that (a bucket that cannot be fetched, one bucket short) leaves the model part old,
        part new: the backend then refuses to step until a complete version is loaded, rather
        than sample from weights no learner ever held.
        """
        self.check_weights_manifest(manifest)
        self._torn_version = manifest.version
        load_buckets_into(self._model, buckets, manifest)
        self._torn_version = None
        self._loaded(manifest.version)

    def check_weights_manifest(self, manifest: WeightsManifest) -> None:
        """StateDictMismatchError unless `manifest` covers exactly the model's tensors."""
        check_manifest(manifest, self._shapes)

    def _loaded(self, version: int) -> None:
        self._version = version
        self._torn_version = None
        if self.recompute_kv:
            self._engine.invalidate_cache()


__all__ = [
    "HFBackend",
    "NonFiniteLogitsError",
    "StateDictMismatchError",
    "left_pad",
    "processed_logprobs",
    "validate_sampling",
]
