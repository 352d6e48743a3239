"""The `vllm` generation backend: vLLM's offline `LLM` engine behind `GenerationBackend`.

- Prompts go in as token ids (`TokensPrompt`), tokenized here with the model's Hugging Face
  tokenizer exactly as the `hf` backend does, so both backends see the same prompt ids.
- Behaviour log-probs come from the engine itself with `logprobs_mode="processed_logprobs"`:
  the log-prob of each sampled token under the distribution it was sampled from, i.e. after
  temperature, top-k and top-p (`SamplingParams(logprobs=0)` asks for the sampled token only).
- Weights are swapped in place in the running engine, with no restart and nothing written to
  disk: the state dict is serialised in memory, sent to every worker with
  `LLM.collective_rpc`, and loaded there by vLLM's own in-place reload
  (`Worker.reload_weights(weights_iterator=...)`, which runs the model's `load_weights` and
  its post-load processing). The worker side is `WeightSyncExtension`, which vLLM mixes into
  its worker class (`worker_extension_cls`). Bytes cross vLLM's process boundaries as they
  are, so this works with the engine core in its own process (vLLM's default) and in-process
  (`VLLM_ENABLE_V1_MULTIPROCESSING=0`); with tensor parallelism every worker receives the
  whole state dict and its model's `load_weights` keeps its own shard. The payload is one
  extra host copy of the weights per update.
- Temperature 0 is greedy decoding: one sample per prompt (vLLM refuses `n > 1` for it)
  repeated across the group, with log-probs 0.0 (a point mass), as in the `hf` backend.
- vLLM is imported lazily: this module imports without it, and constructing the backend
  without it fails with an install hint.

Nothing here is specific to a device: the CPU build of vLLM and the regular GPU build take the
same code; device-dependent choices (dtype, eager mode, KV-cache size) are constructor options.
"""

from __future__ import annotations

import io
import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from services.generation.base import (
    GenerationBackend,
    SamplingSettings,
    StateDictMismatchError,
    encode_prompts,
    validate_sampling,
)
from services.messages import FinishReason, Prompt, Response

if TYPE_CHECKING:
    from vllm import LLM, SamplingParams
    from vllm.outputs import CompletionOutput

INSTALL_HINT = "pip install 'kpo-rl[vllm]'"

# vLLM's engine option that makes returned log-probs those of the distribution actually
# sampled from (after temperature / top-k / top-p); the default, "raw_logprobs", is the
# unmodified model distribution.
VLLM_LOGPROBS_MODE = "processed_logprobs"

# vLLM decodes greedily below this temperature (`vllm.sampling_params._SAMPLING_EPS`).
GREEDY_TEMPERATURE = 1e-5

# Name of the worker method below, called through `LLM.collective_rpc`.
_LOAD_METHOD = "kpo_load_serialized_state_dict"


def _import_vllm() -> Any:
    try:
        import vllm
    except ImportError as exc:
        raise ImportError(
            f"The vllm generation backend needs the vLLM package: {INSTALL_HINT}"
        ) from exc
    return vllm


def serialize_state_dict(state_dict: Mapping[str, torch.Tensor]) -> bytes:
    """Serialise tensors to bytes in memory (CPU copies; shared storage such as tied
    embeddings is kept shared). The result crosses vLLM's process boundary as plain bytes."""
    buffer = io.BytesIO()
    torch.save({name: t.detach().cpu() for name, t in state_dict.items()}, buffer)
    return buffer.getvalue()


def deserialize_state_dict(payload: bytes) -> dict[str, torch.Tensor]:
    """Inverse of `serialize_state_dict`; only tensors are accepted (`weights_only`)."""
    loaded = torch.load(io.BytesIO(payload), map_location="cpu", weights_only=True)
    if not isinstance(loaded, dict):
        raise TypeError(f"expected a state dict, got {type(loaded).__name__}")
    return loaded


class WeightSyncExtension:
    """Methods vLLM adds to its worker class (`worker_extension_cls`) for in-place updates.

    `self` is the vLLM worker; `reload_weights` is its in-place reload of a running model.
    """

    def kpo_load_serialized_state_dict(self, payload: bytes) -> int:
        """Load a serialised state dict into the running model; return the tensor count."""
        weights = deserialize_state_dict(payload)
        self.reload_weights(  # type: ignore[attr-defined]
            weights_iterator=iter(weights.items()), is_checkpoint_format=True
        )
        return len(weights)


_EXTENSION_QUALNAME = f"{__name__}.{WeightSyncExtension.__qualname__}"


def checkpoint_shapes(model_path: str | os.PathLike[str]) -> dict[str, tuple[int, ...]] | None:
    """Tensor names and shapes of a local safetensors checkpoint, from the file headers only.

    None when `model_path` is not a local directory with safetensors files (e.g. a hub name):
    state dicts are then not checked before loading.
    """
    directory = Path(model_path)
    files = sorted(directory.glob("*.safetensors")) if directory.is_dir() else []
    if not files:
        return None
    from safetensors import safe_open

    shapes: dict[str, tuple[int, ...]] = {}
    for file in files:
        with safe_open(str(file), framework="pt") as handle:
            for name in handle.keys():  # noqa: SIM118 (a safetensors handle, not a dict)
                shapes[name] = tuple(handle.get_slice(name).get_shape())
    return shapes


def _ties_embeddings(model_path: str | os.PathLike[str]) -> bool:
    config = Path(model_path) / "config.json"
    if not config.is_file():
        return False
    return bool(json.loads(config.read_text()).get("tie_word_embeddings", False))


def check_state_dict(
    expected: Mapping[str, tuple[int, ...]],
    state_dict: Mapping[str, torch.Tensor],
    tied_embeddings: bool,
) -> None:
    """Raise StateDictMismatchError naming missing, unexpected and wrongly shaped keys.

    `expected` holds the checkpoint's names (Hugging Face names, which the learner's state dict
    uses too). With tied embeddings a checkpoint omits `lm_head.weight` while a state dict may
    carry it; vLLM ignores it then. Rotary `inv_freq` buffers of older checkpoints are ignored.
    """
    ignorable = {"lm_head.weight"} if tied_embeddings else set()
    missing = sorted(set(expected) - set(state_dict))
    unexpected = sorted(
        key
        for key in set(state_dict) - set(expected) - ignorable
        if not key.endswith("rotary_emb.inv_freq")
    )
    wrong_shape = [
        f"{key}: got {tuple(state_dict[key].shape)}, model has {shape}"
        for key, shape in expected.items()
        if key in state_dict and tuple(state_dict[key].shape) != shape
    ]
    if missing or unexpected or wrong_shape:
        raise StateDictMismatchError(
            "state dict does not match the model: "
            f"missing keys {missing}; unexpected keys {unexpected}; wrong shapes {wrong_shape}"
        )


def _finish_reason(output: CompletionOutput) -> FinishReason:
    # vLLM reports "stop" (EOS / stop token), "length" (max_tokens or model length) or
    # "abort"; an aborted request did not run out of budget, so it counts as stopped.
    return "length" if output.finish_reason == "length" else "stop"


class VLLMBackend(GenerationBackend):
    """Generates with a vLLM `LLM` engine and swaps its weights in place.

    Behaviour log-probs (`logprobs_mode = "processed"`): each is the log-prob of the sampled
    token under the distribution it was drawn from, after temperature, top-k and top-p, as
    vLLM's sampler computes it (`logprobs_mode="processed_logprobs"`). With temperature 0
    decoding is greedy and every log-prob is 0.0 (a point mass), as in the `hf` backend.

    Args:
        model_path: a Hugging Face checkpoint directory (or a hub name, where one is reachable;
            state dicts are then loaded without a prior key check).
        tokenizer: tokenizer path; defaults to `model_path`.
        dtype: weight/activation dtype ("auto", "bfloat16", "float32", ...).
        seed: engine seed (used for requests whose sampling settings have no seed).
        max_model_len: longest prompt + response; defaults to the model's context length.
        enforce_eager: skip torch.compile and CUDA-graph capture (faster start-up, slower
            decoding; the sensible choice for tiny models and CPU tests).
        gpu_memory_utilization: fraction of device memory for weights + KV cache (on the CPU
            build: fraction of host memory).
        kv_cache_memory_bytes: explicit KV-cache size; overrides `gpu_memory_utilization`.
            Small values suit tiny models and shared CPU machines.
        tensor_parallel_size: devices one engine spans.
        enable_prefix_caching: vLLM's default when None. The cache is reset after every
            weight update, so cached KV never outlives the weights that produced it.
        engine_kwargs: further `vllm.LLM` / `EngineArgs` options, passed through unchanged.
    """

    def __init__(
        self,
        model_path: str | os.PathLike[str],
        *,
        tokenizer: str | os.PathLike[str] | None = None,
        dtype: str = "auto",
        seed: int = 0,
        max_model_len: int | None = None,
        enforce_eager: bool = False,
        gpu_memory_utilization: float = 0.9,
        kv_cache_memory_bytes: int | None = None,
        tensor_parallel_size: int = 1,
        enable_prefix_caching: bool | None = None,
        engine_kwargs: Mapping[str, Any] | None = None,
    ) -> None:
        """Start the engine on the weights at `model_path`; they are policy version 0."""
        vllm = _import_vllm()
        from transformers import AutoTokenizer

        model = os.fspath(model_path)
        tokenizer_path = os.fspath(tokenizer) if tokenizer is not None else model
        self._tokenizer: Any = AutoTokenizer.from_pretrained(tokenizer_path)
        self._expected_shapes = checkpoint_shapes(model)
        self._tied_embeddings = _ties_embeddings(model)
        options: dict[str, Any] = {
            "tokenizer": tokenizer_path,
            "dtype": dtype,
            "seed": seed,
            "max_model_len": max_model_len,
            "enforce_eager": enforce_eager,
            "gpu_memory_utilization": gpu_memory_utilization,
            "kv_cache_memory_bytes": kv_cache_memory_bytes,
            "tensor_parallel_size": tensor_parallel_size,
            "logprobs_mode": VLLM_LOGPROBS_MODE,
            "worker_extension_cls": _EXTENSION_QUALNAME,
        }
        if enable_prefix_caching is not None:
            options["enable_prefix_caching"] = enable_prefix_caching
        options.update(engine_kwargs or {})
        self._llm: LLM = vllm.LLM(model=model, **options)
        self._version = 0
        self._set_engine_version(0)

    @property
    def policy_version(self) -> int:
        """Version of the weights currently loaded (0 for the weights loaded from disk)."""
        return self._version

    @property
    def tokenizer(self) -> Any:
        """The tokenizer used to encode prompts and decode responses."""
        return self._tokenizer

    @property
    def llm(self) -> LLM:
        """The underlying engine, for callers that need vLLM directly."""
        return self._llm

    def encode(self, prompts: Sequence[Prompt]) -> list[list[int]]:
        """Token ids of each prompt text: the tokenizer's default encoding, as in `hf`."""
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
        from vllm import TokensPrompt

        prompt_ids = self.encode(prompts)
        requests = [TokensPrompt(prompt_token_ids=ids) for ids in prompt_ids]
        # Greedy decoding gives one answer per prompt (and vLLM refuses n > 1 for it): sample
        # once and repeat it across the group.
        greedy = sampling.temperature < GREEDY_TEMPERATURE
        n = 1 if greedy else group_size
        params = [self._sampling_params(sampling, n, i) for i in range(len(prompts))]
        version = self._version
        outputs = self._llm.generate(requests, params, use_tqdm=False)

        groups: list[list[Response]] = []
        for prompt, ids, request_output in zip(prompts, prompt_ids, outputs, strict=True):
            completions = sorted(request_output.outputs, key=lambda c: c.index)
            if len(completions) != n:
                raise RuntimeError(
                    f"vLLM returned {len(completions)} completions for prompt "
                    f"{prompt.prompt_id!r}, expected {n}"
                )
            repeated = completions * (group_size // n)
            groups.append([self._response(prompt, ids, c, version, greedy) for c in repeated])
        return groups

    def load_weights(self, state_dict: Mapping[str, torch.Tensor], version: int) -> None:
        """Load `state_dict` (Hugging Face names) into the running engine and set the version.

        Keys and shapes are checked against the checkpoint first (StateDictMismatchError), so a
        bad state dict leaves the engine and its version untouched. Tensors may be on any
        device or dtype: they are copied into the engine's parameters, which keep theirs.
        """
        if self._expected_shapes is not None:
            check_state_dict(self._expected_shapes, state_dict, self._tied_embeddings)
        elif not state_dict:
            raise StateDictMismatchError("empty state dict")
        payload = serialize_state_dict(state_dict)
        loaded = self._llm.collective_rpc(_LOAD_METHOD, args=(payload,))
        if any(count != len(state_dict) for count in loaded):
            raise RuntimeError(f"workers loaded {loaded} tensors, expected {len(state_dict)}")
        # KV blocks cached for a prefix were computed with the old weights.
        self._llm.reset_prefix_cache()
        self._version = int(version)
        self._set_engine_version(self._version)

    def close(self) -> None:
        """Shut the engine down, its processes included; the backend is unusable afterwards."""
        llm = self.__dict__.pop("_llm", None)
        if llm is not None:
            engine_core = getattr(llm.llm_engine, "engine_core", None)
            if engine_core is not None:
                engine_core.shutdown()

    def _set_engine_version(self, version: int) -> None:
        # vLLM's own record of the weight version (`LLM.update_weight_version`, which stamps
        # outputs with it); older releases lack it.
        update = getattr(self._llm, "update_weight_version", None)
        if update is not None:
            update(str(version))

    def _sampling_params(
        self, sampling: SamplingSettings, group_size: int, prompt_index: int
    ) -> SamplingParams:
        from vllm import SamplingParams

        # vLLM seeds the n samples of one request `seed + j`; spacing prompts `group_size`
        # apart gives every sample of the batch its own stream, deterministic in `seed`.
        seed = None if sampling.seed is None else sampling.seed + prompt_index * group_size
        return SamplingParams(
            n=group_size,
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            top_k=sampling.top_k,  # 0 disables top-k in vLLM, as in SamplingSettings
            max_tokens=sampling.max_new_tokens,
            seed=seed,
            logprobs=0,  # the sampled token's log-prob only
            detokenize=False,  # text is decoded below with the Hugging Face tokenizer
        )

    def _response(
        self,
        prompt: Prompt,
        prompt_ids: list[int],
        output: CompletionOutput,
        version: int,
        greedy: bool,
    ) -> Response:
        token_ids = [int(t) for t in output.token_ids]
        logprobs = [0.0] * len(token_ids) if greedy else _sampled_logprobs(output, token_ids)
        return Response(
            prompt_id=prompt.prompt_id,
            prompt_token_ids=list(prompt_ids),
            response_token_ids=token_ids,
            behaviour_logprobs=logprobs,
            finish_reason=_finish_reason(output),
            policy_version=version,
            text=self._tokenizer.decode(token_ids, skip_special_tokens=True),
        )


def _sampled_logprobs(output: CompletionOutput, token_ids: Sequence[int]) -> list[float]:
    """The log-prob of each sampled token, from vLLM's per-position {token: Logprob} maps."""
    logprobs = output.logprobs
    if logprobs is None or len(logprobs) != len(token_ids):
        raise RuntimeError("vLLM returned no log-prob for some sampled tokens")
    values: list[float] = []
    for position, token in enumerate(token_ids):
        entry = logprobs[position]
        if entry is None or token not in entry:
            raise RuntimeError(f"vLLM returned no log-prob for sampled token at {position}")
        values.append(float(entry[token].logprob))
    return values
