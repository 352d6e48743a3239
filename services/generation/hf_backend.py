"""The `hf` generation backend: transformers on CPU or GPU, with our own sampling loop.

`model.generate` is deliberately not used: the learner's importance ratios are taken against the
behaviour log-probs, so the distribution each token is sampled from, and the log-prob reported
for it, must be exactly the ones computed here (see `processed_logprobs`).
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache, PreTrainedModel

from services.generation.base import (
    GenerationBackend,
    SamplingSettings,
    StateDictMismatchError,
    encode_prompts,
    validate_sampling,
)
from services.messages import FinishReason, Prompt, Response


def processed_logprobs(logits: torch.Tensor, sampling: SamplingSettings) -> torch.Tensor:
    """Log-probs of the distribution sampled from, given next-token `logits` of shape (B, V).

    In order: divide by the temperature (which must be > 0), keep the `top_k` largest logits
    (ties with the k-th are kept), keep the smallest set of most likely tokens whose probability
    reaches `top_p`, then renormalise. Tokens outside the kept set get -inf. With temperature 1,
    top_k 0 and top_p 1 this is exactly `log_softmax(logits)`. Computed in float32.
    """
    scaled = logits.float() / sampling.temperature
    if 0 < sampling.top_k < scaled.shape[-1]:
        kth_largest = torch.topk(scaled, sampling.top_k, dim=-1).values[..., -1:]
        scaled = scaled.masked_fill(scaled < kth_largest, float("-inf"))
    if sampling.top_p < 1:
        sorted_logits, order = scaled.sort(dim=-1, descending=True)
        sorted_probs = sorted_logits.softmax(dim=-1)
        # A token is dropped when the tokens ranked above it already reach top_p; the most likely
        # token has zero mass above it, so at least one token always survives.
        mass_above = sorted_probs.cumsum(dim=-1) - sorted_probs
        drop = torch.zeros_like(mass_above, dtype=torch.bool)
        drop.scatter_(-1, order, mass_above >= sampling.top_p)
        scaled = scaled.masked_fill(drop, float("-inf"))
    return scaled.log_softmax(dim=-1)


def sample_next(
    logits: torch.Tensor, sampling: SamplingSettings, generator: torch.Generator | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row of `logits` (B, V); return (tokens, their processed log-probs).

    Temperature 0 means greedy decoding: the processed distribution is then a point mass on the
    arg-max token, so its log-prob is reported as 0.0.
    """
    if sampling.temperature == 0:
        tokens = logits.argmax(dim=-1)
        return tokens, torch.zeros(tokens.shape, dtype=torch.float32, device=logits.device)
    logprobs = processed_logprobs(logits, sampling)
    tokens = torch.multinomial(logprobs.exp(), num_samples=1, generator=generator)
    return tokens.squeeze(-1), logprobs.gather(-1, tokens).squeeze(-1)


def left_pad(
    rows: Sequence[Sequence[int]], pad_id: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-pad token id rows into (input_ids, attention_mask), both (B, max_len) int64."""
    width = max(len(row) for row in rows)
    input_ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(rows), width), dtype=torch.long)
    for index, row in enumerate(rows):
        if row:
            input_ids[index, width - len(row) :] = torch.tensor(row, dtype=torch.long)
            attention_mask[index, width - len(row) :] = 1
    return input_ids.to(device), attention_mask.to(device)


def position_ids_for(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions counted from each row's first real token, so left padding does not shift them.

    Padding slots get position 0; they are masked out, so their value never matters. (Rotary
    models only see position differences within a row, but the prefill and every decode step
    must agree on them, and models with absolute positions see the values themselves.)
    """
    return (attention_mask.cumsum(dim=-1) - 1).clamp(min=0)


def check_state_dict(model: torch.nn.Module, state_dict: Mapping[str, torch.Tensor]) -> None:
    """Raise StateDictMismatchError naming missing, unexpected and wrongly shaped keys.

    A key may be absent when another key of the same tied tensor (e.g. `lm_head.weight` tied
    to the input embedding) is present, since loading either fills both.
    """
    expected = model.state_dict()
    aliases: dict[int, set[str]] = {}
    for key, tensor in expected.items():
        aliases.setdefault(tensor.data_ptr(), set()).add(key)
    missing = [
        key
        for key, tensor in expected.items()
        if not aliases[tensor.data_ptr()] & state_dict.keys()
    ]
    unexpected = sorted(set(state_dict) - set(expected))
    wrong_shape = [
        f"{key}: got {tuple(state_dict[key].shape)}, model has {tuple(tensor.shape)}"
        for key, tensor in expected.items()
        if key in state_dict and state_dict[key].shape != tensor.shape
    ]
    if missing or unexpected or wrong_shape:
        raise StateDictMismatchError(
            "state dict does not match the model: "
            f"missing keys {missing}; unexpected keys {unexpected}; wrong shapes {wrong_shape}"
        )


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
    temperature IS applied) and top-k / top-p truncation, renormalised over the kept tokens.
    With temperature 1, top_k 0 and top_p 1 that equals the model's plain log-softmax, which is
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
    ) -> None:
        """Load model and tokenizer from `model_path`; weights start as policy version 0."""
        self._device = torch.device(device)
        extra: dict[str, Any] = {}
        if attn_implementation is not None:
            extra["attn_implementation"] = attn_implementation
        model: PreTrainedModel = AutoModelForCausalLM.from_pretrained(
            str(model_path), dtype=_resolve_dtype(dtype), **extra
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
        """Token ids of each prompt text, as the model is conditioned on them (no padding)."""
        return encode_prompts(self._tokenizer, prompts)

    def generate(
        self, prompts: list[Prompt], group_size: int, sampling: SamplingSettings
    ) -> list[list[Response]]:
        """Return `group_size` responses for each prompt, in prompt order, in one batch.

        With `sampling.seed` set, the same prompts, group size and settings give the same
        responses.
        """
        validate_sampling(sampling, group_size)
        if not prompts:
            return []
        prompt_ids = self.encode(prompts)
        rows = [ids for ids in prompt_ids for _ in range(group_size)]
        generator = None
        if sampling.seed is not None:
            generator = torch.Generator(device=self._device).manual_seed(sampling.seed)
        tokens, logprobs = self._sample(rows, sampling, generator)
        responses = self._to_responses(prompts, prompt_ids, group_size, tokens, logprobs)
        return [responses[i * group_size : (i + 1) * group_size] for i in range(len(prompts))]

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

    @torch.inference_mode()
    def _sample(
        self,
        rows: list[list[int]],
        sampling: SamplingSettings,
        generator: torch.Generator | None,
    ) -> tuple[list[list[int]], list[list[float]]]:
        """Run the KV-cached sampling loop; return each row's sampled tokens and log-probs.

        A row leaves the batch, cache entries included, at the step it emits EOS, so finished
        rows cost nothing afterwards; its later slots stay padding, cut by `_to_responses`.
        """
        input_ids, attention_mask = left_pad(rows, self._pad_id, self._device)
        position_ids = position_ids_for(attention_mask)
        eos_ids = torch.tensor(self._eos_ids, dtype=torch.long, device=self._device)
        running = torch.arange(len(rows), device=self._device)  # row index of each batch entry
        shape = (len(rows), sampling.max_new_tokens)
        out_tokens = torch.full(shape, self._pad_id, dtype=torch.long, device=self._device)
        out_logprobs = torch.zeros(shape, dtype=torch.float32, device=self._device)
        cache = DynamicCache(config=self._model.config)
        for step in range(sampling.max_new_tokens):
            logits = self._forward(input_ids, attention_mask, position_ids, cache)
            tokens, logprobs = sample_next(logits, sampling, generator)
            out_tokens[running, step] = tokens
            out_logprobs[running, step] = logprobs
            going = ~torch.isin(tokens, eos_ids)
            if not bool(going.all()):
                if not bool(going.any()):
                    break
                keep = going.nonzero().squeeze(-1)
                cache.batch_select_indices(keep)
                running, tokens = running[keep], tokens[keep]
                attention_mask, position_ids = attention_mask[keep], position_ids[keep]
            attention_mask = torch.nn.functional.pad(attention_mask, (0, 1), value=1)
            input_ids, position_ids = tokens[:, None], position_ids[:, -1:] + 1
        return out_tokens.tolist(), out_logprobs.tolist()

    def _to_responses(
        self,
        prompts: list[Prompt],
        prompt_ids: list[list[int]],
        group_size: int,
        tokens: list[list[int]],
        logprobs: list[list[float]],
    ) -> list[Response]:
        """Cut each row after its first EOS and package it as a Response (flat, row order)."""
        eos = set(self._eos_ids)
        cut: list[tuple[list[int], list[float], FinishReason]] = []
        for row_tokens, row_logprobs in zip(tokens, logprobs, strict=True):
            end = next((i + 1 for i, token in enumerate(row_tokens) if token in eos), None)
            if end is None:
                cut.append((row_tokens, row_logprobs, "length"))
            else:
                cut.append((row_tokens[:end], row_logprobs[:end], "stop"))
        texts = self._tokenizer.batch_decode([ids for ids, _, _ in cut], skip_special_tokens=True)
        return [
            Response(
                prompt_id=prompts[row // group_size].prompt_id,
                prompt_token_ids=list(prompt_ids[row // group_size]),
                response_token_ids=ids,
                behaviour_logprobs=row_logprobs,
                finish_reason=reason,
                policy_version=self._version,
                text=text,
            )
            for row, ((ids, row_logprobs, reason), text) in enumerate(zip(cut, texts, strict=True))
        ]

    def load_weights(self, state_dict: Mapping[str, torch.Tensor], version: int) -> None:
        """Copy `state_dict` into the live model's parameters in place and set the version.

        Keys and shapes are checked first (StateDictMismatchError), so a bad state dict leaves
        the model and its version untouched. Tensors may be on any device or dtype: they are
        copied into the existing parameters, which keep theirs.
        """
        check_state_dict(self._model, state_dict)
        with torch.no_grad():
            # Keys were checked above; strict=False only lets a tied alias be absent.
            self._model.load_state_dict(dict(state_dict), strict=False)
        self._version = int(version)


__all__ = ["HFBackend", "StateDictMismatchError", "processed_logprobs", "validate_sampling"]
