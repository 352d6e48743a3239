"""The `vllm` generation backend: vLLM's `LLM` engine behind `GenerationBackend`.

Prompts and log-probs:
- Prompts go in as token ids (`TokensPrompt`), tokenized here with the model's Hugging Face
  tokenizer exactly as the `hf` backend does, so both backends see the same prompt ids.
- Behaviour log-probs come from the engine itself with `logprobs_mode="processed_logprobs"`:
  the log-prob of each sampled token under the distribution it was sampled from, i.e. after
  temperature, min-p, top-k and top-p (`SamplingParams(logprobs=0)` asks for the sampled token
  only).
- Kept sets (`SamplingSettings.replay_max_kept`, for the learner's truncated-sampling replay):
  in that mode the top log-probs vLLM returns are those of the processed distribution too, -inf
  outside what min-p / top-k / top-p kept. A request that records sets asks for its
  `replay_max_kept + 1` most likely tokens (fewer under a smaller top-k): the finite ones are the
  token's kept set, and a token whose asked-for ones are all finite kept more than that (the set
  is recorded empty, over the limit, and the learner drops the token). Only vLLM's own sampler
  sees the set, and this is its supported way of reporting what it saw (no patched sampler, no
  logits processor that would have to re-derive the truncation).
- Temperature 0 is greedy decoding: one sample per prompt (vLLM refuses `n > 1` for it)
  repeated across the group, with log-probs 0.0 (a point mass), as in the `hf` backend.

Streaming: `submit` adds one vLLM request per group, with `n = G` (`LLM.enqueue`). vLLM fans
it out into G sequences that share the prompt's KV blocks, and with `RequestOutputKind.
FINAL_ONLY` it reports the parent request once, when its last sequence ends: exactly "a group
comes back when its G responses have ended", without regrouping G independent requests here.
`step` is one `LLMEngine.step` (one batch of engine-core outputs, i.e. one decoding step) and
returns the groups that ended in it. With the engine core in its own process (vLLM's default)
it runs ahead on its own and `step` takes its outputs in order; the version bookkeeping below
does not depend on how far ahead it is.

Weights (`load_weights`, `load_weight_buckets`, the collective methods) are loaded in place in
the running engine, bucket by bucket, by `vllm_worker_extension` inside every vLLM worker; the
buckets travel as described in `vllm_transfer` (shared memory, or the learner's process group),
never as one payload proportional to the model.

Which version sampled each token (in-flight updates): vLLM's engine core stamps every batch of
outputs with its current weight version (`set_weight_version`) and the output processor turns
the stamps into per-sequence spans (`CompletionOutput.weight_versions`). The stamp is exact if
the weights and the label change together between two engine steps, so every load runs with
the scheduler paused keeping its requests (`sleep(level=0, mode="keep")`: the pause completes
once the engine core is idle, so every step already executed, the batches queued by async
scheduling included, produced its outputs under the old weights and the old label), then loads,
sets the label, and resumes. Tokens sampled before the pause carry the old version, the ones
after it the new one, whatever the engine core's lead over `step`; and each token's log-prob is
computed by the sampler from the logits of the weights that sampled it.

Multi-turn rollouts (`enable_tools`, for prompts that take tools): each response is a vLLM
request of its own, decoded in segments that stop at tool calls; its call runs off the stepping
thread while the other requests keep decoding, and the next segment resubmits the whole context
as a token prompt (`vllm_tools`, which shares the `hf` backend's turn logic, limits and
observation tokens). A prompt that takes no tools (`Prompt.takes_tools`) is a plain request.

KV cache across an in-flight load (`recompute_kv`): False keeps the KV blocks of the requests
in flight (computed by the old weights) and the prefix cache is reset only where no request
holds a block; new requests are salted with the version they were submitted under
(`cache_salt`), so they never reuse prefix blocks computed before that version was loaded
(requests queued before the load may: the same bias as kept KV). True preempts every running
request after the load (`reset_prefix_cache(reset_running_requests=True)`): vLLM recomputes
their prompt and generated tokens under the new weights before they continue, at the cost of a
prefill.

vLLM is imported lazily: this module imports without it, and constructing the backend without
it fails with an install hint. Nothing here is specific to a device: the CPU build of vLLM and
the GPU build take the same code; device-dependent choices (dtype, eager mode, KV-cache size)
are constructor options. Relies on vLLM >= 0.32 (weight-version spans, pausing that keeps
requests).
"""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from services.generation.base import (
    GenerationBackend,
    GroupRequest,
    SamplingSettings,
    check_prompt_lengths,
    encode_prompts,
    validate_requests,
)
from services.generation.vllm_checkpoint import (
    check_state_dict,
    checkpoint_shapes,
    ignorable_names,
    state_dict_buckets,
    ties_embeddings,
)
from services.generation.vllm_tools import MultiTurn, Segment, ToolGroup, ToolRow
from services.generation.vllm_transfer import (
    group_to_wire,
    manifest_to_wire,
    shared_bucket_to_wire,
)
from services.generation.vllm_worker_extension import WeightLoadingExtension
from services.messages import FinishReason, Prompt, Response
from services.tools.config import ToolsConfig
from services.tools.rollout import ToolRollout
from services.tools.sandbox import ToolRunner
from services.weights.base import StateDictMismatchError, WeightGroup, WeightsManifest
from services.weights.buckets import bucket_tensors
from services.weights.loading import check_manifest
from services.weights.shared_memory import shared_bucket
from services.weights.stores import member_host

if TYPE_CHECKING:
    from vllm import LLM, SamplingParams
    from vllm.outputs import CompletionOutput, RequestOutput

INSTALL_HINT = "pip install 'kpo-rl[vllm]'"

# vLLM's engine option that makes returned log-probs those of the distribution actually
# sampled from (after temperature / top-k / top-p); the default, "raw_logprobs", is the
# unmodified model distribution.
VLLM_LOGPROBS_MODE = "processed_logprobs"

# The most top log-probs a request may ask for (vLLM's `max_logprobs`): a kept set of the
# largest `generation.replay_max_kept` a spec allows (services/spec/bounds.py's
# MAX_REPLAY_KEPT, 4096, which this layer may not import; a test holds them together) and the
# one more that tells it was not larger.
VLLM_MAX_LOGPROBS = 4096 + 1

# vLLM decodes greedily below this temperature (`vllm.sampling_params._SAMPLING_EPS`).
GREEDY_TEMPERATURE = 1e-5

# Buckets of a state dict handed to `load_weights` (the publishing paths bring their own).
STATE_DICT_BUCKET_BYTES = 256 * 2**20

_EXTENSION_QUALNAME = f"{WeightLoadingExtension.__module__}.{WeightLoadingExtension.__qualname__}"


def _import_vllm() -> Any:
    try:
        import vllm
    except ImportError as exc:
        raise ImportError(
            f"The vllm generation backend needs the vLLM package: {INSTALL_HINT}"
        ) from exc
    return vllm


def _finish_reason(output: CompletionOutput) -> FinishReason:
    # vLLM reports "stop" (EOS / stop token), "length" (max_tokens or model length) or
    # "abort"; an aborted request did not run out of budget, so it counts as stopped.
    return "length" if output.finish_reason == "length" else "stop"


@dataclass(frozen=True)
class _Group:
    """A submitted group: what its responses are built from once vLLM reports it ended."""

    request: GroupRequest
    prompt_ids: list[int]
    greedy: bool  # sampled once, repeated G times
    version: int  # the version loaded when it was submitted


class VLLMBackend(GenerationBackend):
    """Generates with a vLLM `LLM` engine, streams groups as they end, and loads weights in
    place between steps (see the module docstring for how versions and KV are kept exact).

    Args:
        model_path: a Hugging Face checkpoint directory (or a hub name, where one is reachable;
            weights are then loaded without a prior key check).
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
        tensor_parallel_size: devices one engine spans (each a worker that loads its shard and
            joins a collective weight group).
        enable_prefix_caching: vLLM's default when None. Cached blocks never outlive the
            weights that computed them for new requests (see the module docstring).
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
        self._tied_embeddings = ties_embeddings(model)
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
            "max_logprobs": VLLM_MAX_LOGPROBS,
            "worker_extension_cls": _EXTENSION_QUALNAME,
        }
        if enable_prefix_caching is not None:
            options["enable_prefix_caching"] = enable_prefix_caching
        options.update(engine_kwargs or {})
        self._llm: LLM = vllm.LLM(model=model, **options)
        # Width of the logits (the kept sets' universe; may exceed the tokenizer's length).
        self._vocab_size = int(self._llm.llm_engine.model_config.get_vocab_size())
        self._version = 0
        self._llm.update_weight_version("0")  # the label every output is stamped with
        self._groups: dict[str, _Group] = {}  # vLLM request id -> group in flight
        self._torn_version: int | None = None  # a version only partly loaded
        self._weight_group: WeightGroup | None = None
        self._staged_version: int | None = None
        # Multi-turn rollouts, once `enable_tools` was called.
        self._multi: MultiTurn | None = None
        self._segments: dict[str, ToolRow] = {}  # vLLM request id -> response it decodes
        self._tool_groups = 0  # multi-turn groups submitted and not yet returned

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

    @property
    def max_model_len(self) -> int:
        """Longest prompt + response the engine takes."""
        return int(self._llm.llm_engine.vllm_config.model_config.max_model_len)

    def encode(self, prompts: Sequence[Prompt]) -> list[list[int]]:
        """Token ids of each prompt text: the tokenizer's default encoding, as in `hf`; chat
        prompts declare the tool when tool calls are Hermes-style."""
        tools = self._multi.tools.encoder.prompt_tools() if self._multi is not None else None
        return encode_prompts(self._tokenizer, prompts, tools)

    # --- multi-turn rollouts --------------------------------------------------------------------

    def enable_tools(self, settings: ToolsConfig, runner: ToolRunner) -> None:
        """Multi-turn rollouts from now on (see `GenerationBackend.enable_tools`)."""
        if self.in_flight:
            raise RuntimeError("enable_tools needs an idle backend")
        if self._multi is not None:
            self._multi.tools.close()
        self._multi = MultiTurn(
            ToolRollout(settings, runner, self._tokenizer),
            decode_text=lambda ids: str(
                self._tokenizer.decode(list(ids), skip_special_tokens=False)
            ),
            context_limit=self.max_model_len,
        )

    def tool_call_counts(self) -> dict[str, int]:
        """Tool calls run since `enable_tools`, by result status."""
        return self._multi.tools.calls.counts() if self._multi is not None else {}

    @property
    def tools(self) -> ToolRollout | None:
        """The multi-turn machinery, once `enable_tools` was called."""
        return self._multi.tools if self._multi is not None else None

    # --- streaming ------------------------------------------------------------------------------

    def submit(self, requests: Sequence[GroupRequest]) -> None:
        """Add one vLLM request per group (`n = G`); the engine admits them as room allows.

        Every request is validated and encoded first, so a bad one adds nothing.
        """
        validate_requests(requests)
        if not requests:
            return
        from vllm import TokensPrompt

        prompt_ids = self.encode([request.prompt for request in requests])
        check_prompt_lengths(requests, prompt_ids, self.max_model_len)
        if self._multi is not None:
            multi_turn = [i for i, r in enumerate(requests) if r.prompt.takes_tools]
            self._submit_multi_turn(
                self._multi, [requests[i] for i in multi_turn], [prompt_ids[i] for i in multi_turn]
            )
            single = [i for i, r in enumerate(requests) if not r.prompt.takes_tools]
            requests, prompt_ids = [requests[i] for i in single], [prompt_ids[i] for i in single]
            if not requests:
                return
        salt = f"kpo-v{self._version}"
        prompts = [TokensPrompt(prompt_token_ids=ids, cache_salt=salt) for ids in prompt_ids]
        greedy = [r.sampling.temperature < GREEDY_TEMPERATURE for r in requests]
        params = [
            # Greedy decoding gives one answer per prompt (and vLLM refuses n > 1 for it):
            # sample once and repeat it across the group.
            self._sampling_params(r.sampling, 1 if g else r.group_size)
            for r, g in zip(requests, greedy, strict=True)
        ]
        request_ids = self._llm.enqueue(prompts, params, use_tqdm=False)
        for request_id, request, ids, g in zip(
            request_ids, requests, prompt_ids, greedy, strict=True
        ):
            self._groups[_external_id(request_id)] = _Group(request, ids, g, self._version)

    def step(self) -> list[list[Response]]:
        """Take one engine step's outputs; return the groups that ended in it (each its G
        responses, in sample order). Refuses to run on partly loaded weights."""
        if self._torn_version is not None:
            raise RuntimeError(
                f"weights of version {self._torn_version} were only partly loaded; load a "
                "complete version before generating"
            )
        ended: list[list[Response]] = []
        if self._multi is not None:
            ended += self._resume_parked(self._multi)
        if not self._groups and not self._segments:
            if self._multi is not None and not ended:
                self._multi.parked.wait_for_a_call()
            return ended
        for output in self._llm.llm_engine.step():
            if not output.finished:
                continue
            row = self._segments.pop(output.request_id, None)
            if row is not None:
                response = self._segment_ended(row, output)
                if response is not None:
                    ended.append(response)
                continue
            group = self._groups.pop(output.request_id, None)
            if group is None:
                raise RuntimeError(f"vLLM returned request {output.request_id!r}, never submitted")
            ended.append(self._group_responses(group, output))
        return ended

    @property
    def in_flight(self) -> int:
        """Groups submitted and not yet returned by `step`."""
        return len(self._groups) + self._tool_groups

    # --- multi-turn: segments, calls, observations (see vllm_tools) ----------------------------

    def _submit_multi_turn(
        self, multi: MultiTurn, requests: Sequence[GroupRequest], prompt_ids: list[list[int]]
    ) -> None:
        rows: list[ToolRow] = []
        for request, ids in zip(requests, prompt_ids, strict=True):
            greedy = request.sampling.temperature < GREEDY_TEMPERATURE
            group: ToolGroup = multi.new_group(request, ids, greedy, self._version)
            rows += group.rows
        self._tool_groups += len(requests)
        self._submit_segments(multi, rows)

    def _submit_segments(self, multi: MultiTurn, rows: Sequence[ToolRow]) -> None:
        """One vLLM request per row: its whole context, its remaining budget."""
        if not rows:
            return
        from vllm import SamplingParams, TokensPrompt

        salt = f"kpo-v{self._version}"
        prompts: list[TokensPrompt] = []
        params: list[SamplingParams] = []
        for row in rows:
            context, max_tokens, seed = multi.next_segment(row)
            row.submitted_version = self._version
            prompts.append(TokensPrompt(prompt_token_ids=context, cache_salt=salt))
            sampling = row.group.request.sampling
            params.append(
                SamplingParams(
                    n=1,
                    temperature=sampling.temperature,
                    top_p=sampling.top_p,
                    top_k=sampling.top_k,
                    min_p=sampling.min_p,
                    max_tokens=max_tokens,
                    seed=seed,
                    logprobs=_logprobs_asked(sampling, self._vocab_size),
                    # Stop strings need vLLM's detokenizer; the text it makes is not used
                    # (calls are read from the Hugging Face tokenizer's decoding).
                    stop=multi.stop_strings,
                    include_stop_str_in_output=True,
                    detokenize=True,
                    skip_special_tokens=False,
                    spaces_between_special_tokens=False,
                )
            )
        request_ids = self._llm.enqueue(prompts, params, use_tqdm=False)
        for request_id, row in zip(request_ids, rows, strict=True):
            self._segments[_external_id(request_id)] = row

    def _segment_ended(self, row: ToolRow, output: RequestOutput) -> list[Response] | None:
        """Take a row's ended segment: park it on its call, resubmit it, or end it."""
        multi = self._multi
        assert multi is not None
        [completion] = output.outputs
        token_ids = [int(t) for t in completion.token_ids]
        versions = _token_versions(completion, len(token_ids), row.submitted_version)
        greedy = row.group.greedy
        logprobs = [0.0] * len(token_ids) if greedy else _sampled_logprobs(completion, token_ids)
        kept = _kept_sets(
            completion, token_ids, row.group.request.sampling, greedy, self._vocab_size
        )
        stop_string = completion.finish_reason == "stop" and isinstance(completion.stop_reason, str)
        eos = completion.finish_reason == "stop" and not stop_string
        segment = Segment(token_ids, logprobs, versions, eos, stop_string, kept)
        decision = multi.segment_ended(row, segment)
        if decision == "continue":
            self._submit_segments(multi, [row])
            return None
        if decision == "call":
            multi.parked.park(row)
            return None
        row.finish = _finish_reason(completion) if decision is None else decision
        return self._retire(row)

    def _resume_parked(self, multi: MultiTurn) -> list[list[Response]]:
        """Resubmit every parked row whose call ended (its observation appended), or end it
        when the observation does not fit; the groups that ended."""
        done, ready = multi.parked.take_ready()
        ended = [group for row in done if (group := self._retire(row)) is not None]
        self._submit_segments(multi, ready)
        return ended

    def _retire(self, row: ToolRow) -> list[Response] | None:
        assert self._multi is not None
        group = self._multi.retire(
            row, lambda ids: self._tokenizer.decode(ids, skip_special_tokens=True)
        )
        if group is not None:
            self._tool_groups -= 1
        return group

    def _group_responses(self, group: _Group, output: RequestOutput) -> list[Response]:
        n = 1 if group.greedy else group.request.group_size
        completions = sorted(output.outputs, key=lambda c: c.index)
        if len(completions) != n:
            raise RuntimeError(
                f"vLLM returned {len(completions)} completions for prompt "
                f"{group.request.prompt.prompt_id!r}, expected {n}"
            )
        repeated = completions * (group.request.group_size // n)
        return [self._response(group, completion) for completion in repeated]

    def _response(self, group: _Group, output: CompletionOutput) -> Response:
        token_ids = [int(t) for t in output.token_ids]
        versions = _token_versions(output, len(token_ids), group.version)
        logprobs = [0.0] * len(token_ids) if group.greedy else _sampled_logprobs(output, token_ids)
        kept = _kept_sets(output, token_ids, group.request.sampling, group.greedy, self._vocab_size)
        return Response(
            prompt_id=group.request.prompt.prompt_id,
            prompt_token_ids=list(group.prompt_ids),
            response_token_ids=token_ids,
            behaviour_logprobs=logprobs,
            finish_reason=_finish_reason(output),
            policy_version=versions[0] if versions else group.version,
            text=self._tokenizer.decode(token_ids, skip_special_tokens=True),
            token_versions=versions if len(set(versions)) > 1 else [],
            kept_ids=kept or [],
        )

    def _sampling_params(self, sampling: SamplingSettings, n: int) -> SamplingParams:
        from vllm import SamplingParams

        return SamplingParams(
            n=n,
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            top_k=sampling.top_k,  # 0 disables top-k in vLLM, as in SamplingSettings
            min_p=sampling.min_p,  # 0 disables min-p, as in SamplingSettings
            max_tokens=sampling.max_new_tokens,
            # vLLM seeds the n samples of one request `seed + j`.
            seed=sampling.seed,
            # The sampled token's log-prob, and the top ones that tell its kept set.
            logprobs=_logprobs_asked(sampling, self._vocab_size),
            detokenize=False,  # text is decoded with the Hugging Face tokenizer
        )

    # --- weights --------------------------------------------------------------------------------

    def load_weights(self, state_dict: Mapping[str, torch.Tensor], version: int) -> None:
        """Load `state_dict` (Hugging Face names) into the running engine and set the version.

        Keys and shapes are checked against the checkpoint first (StateDictMismatchError), so a
        bad state dict leaves the engine and its version untouched. Tensors may be on any
        device or dtype: they are copied into the engine's parameters, which keep theirs. Sent
        in buckets of `STATE_DICT_BUCKET_BYTES`, like a publish.
        """
        if self._expected_shapes is not None:
            check_state_dict(self._expected_shapes, state_dict, self._tied_embeddings)
        elif not state_dict:
            raise StateDictMismatchError("empty state dict")
        manifest, buckets = state_dict_buckets(state_dict, version, STATE_DICT_BUCKET_BYTES)
        self._load_buckets(buckets, manifest)

    def load_weight_buckets(
        self, buckets: Iterable[Mapping[str, torch.Tensor]], manifest: WeightsManifest
    ) -> None:
        """Load a published version bucket by bucket, in place, and set its version; may run
        between two `step`s with groups in flight (their next tokens are the new version's).

        The manifest is checked first, so a mismatched one changes nothing. A failure after
        that (a bucket that cannot be fetched, one bucket short) leaves the model part old,
        part new: the backend then refuses to step until a complete version is loaded.
        """
        self.check_weights_manifest(manifest)
        self._load_buckets(buckets, manifest)

    def check_weights_manifest(self, manifest: WeightsManifest) -> None:
        """StateDictMismatchError unless `manifest` covers exactly the checkpoint's tensors
        (plus names vLLM skips: a tied model's `lm_head.weight`, rotary `inv_freq`)."""
        if not manifest.buckets:
            raise StateDictMismatchError(f"weights of version {manifest.version}: no tensors")
        if self._expected_shapes is not None:
            check_manifest(manifest, self._expected_shapes, ignorable_names(self._tied_embeddings))

    def _load_buckets(
        self, buckets: Iterable[Mapping[str, torch.Tensor]], manifest: WeightsManifest
    ) -> None:
        """Pause, load every bucket through shared memory, label, resume (manifest checked)."""
        with self._generation_paused():
            self._torn_version = manifest.version
            self._rpc("kpo_begin_weight_update")
            try:
                self._send_buckets(buckets, manifest)
            except BaseException:
                # Closed even after a failure: the workers' model must not stay mid-reload (a
                # failure of this call too is secondary to the one being raised).
                with contextlib.suppress(Exception):
                    self._rpc("kpo_finish_weight_update")
                raise
            self._rpc("kpo_finish_weight_update")
            self._loaded(manifest.version)

    def _send_buckets(
        self, buckets: Iterable[Mapping[str, torch.Tensor]], manifest: WeightsManifest
    ) -> None:
        """Hand every bucket to the workers through a shared file, one bucket at a time."""
        loaded = 0
        remaining = iter(manifest.buckets)
        for bucket in buckets:
            specs = next(remaining, None)
            if specs is None:
                raise ValueError(
                    f"weights of version {manifest.version}: more buckets than the "
                    f"manifest's {len(manifest.buckets)}"
                )
            tensors = bucket_tensors(bucket, specs)
            names = {spec.name for spec in specs}
            aliases = {a: n for a, n in manifest.aliases.items() if n in names}
            with shared_bucket(tensors, specs) as shared:
                self._rpc("kpo_load_shared_bucket", shared_bucket_to_wire(shared), aliases)
            loaded += 1
            del tensors, bucket  # one bucket held at a time
        if loaded != len(manifest.buckets):
            raise ValueError(
                f"weights of version {manifest.version}: got {loaded} of "
                f"{len(manifest.buckets)} buckets"
            )

    def _loaded(self, version: int) -> None:
        """The new weights are in (called paused): label them, settle the KV cache."""
        self._llm.update_weight_version(str(version))
        if self.recompute_kv:
            # Preempts every running request: vLLM recomputes its prompt and generated tokens
            # under the new weights when it is scheduled again; the whole cache is cleared.
            self._llm.reset_prefix_cache(reset_running_requests=True)
        else:
            # Clears the cache only where no running request holds a block (returns False
            # otherwise); the version salt keeps new requests off what stays.
            self._llm.reset_prefix_cache()
        self._version = int(version)
        self._torn_version = None

    @contextlib.contextmanager
    def _generation_paused(self) -> Iterator[None]:
        """Stop the engine core between two steps, keeping its requests and their KV; resume.

        `sleep(level=0, mode="keep")` returns once the engine core is idle (every executed step
        has put out its outputs); requests added meanwhile would queue.
        """
        self._llm.sleep(level=0, mode="keep")
        try:
            yield
        finally:
            self._llm.wake_up(tags=["scheduling"])

    def _rpc(self, method: str, *args: Any) -> list[Any]:
        """Call `method` of the worker extension on every vLLM worker (control messages only)."""
        results: list[Any] = self._llm.collective_rpc(method, args=args)
        return results

    # --- the collective transport ---------------------------------------------------------------

    def weight_receivers(self) -> int:
        """vLLM's workers: one per tensor-parallel rank of each pipeline stage."""
        return int(self._llm.get_world_size(include_dp=False))

    def join_weight_group(self, group: WeightGroup, first_rank: int) -> None:
        """Every vLLM worker joins `group`, worker w as rank `first_rank + w` (blocks until every
        rank joined). Leaves a group joined before."""
        self.close_weight_group()
        self._rpc(
            "kpo_join_weight_group", group_to_wire(group), first_rank, member_host(group.address)
        )
        self._weight_group = group

    def close_weight_group(self) -> None:
        """Every worker leaves the group, if one was joined."""
        if self._weight_group is not None:
            self._weight_group = None
            self._rpc("kpo_leave_weight_group")

    def receive_weights(self, manifest: WeightsManifest, apply: bool) -> None:
        """Every worker receives every bucket of `manifest` from the group now.

        apply=True loads them into the live model as they arrive (generation paused meanwhile)
        and sets the version; apply=False keeps them on each worker's CPU for `apply_staged`.
        Either way decoding waits for the broadcast: vLLM's engine core runs a
        `collective_rpc` between two steps, so apply=False only defers the load (each worker
        then holds a host copy of the full tensors, its shard is cut at `apply_staged`).
        A manifest that does not fit the model is still received (the sender and the other
        receivers must not be left waiting), then the mismatch raised.
        """
        if self._weight_group is None:
            raise RuntimeError("receive_weights before join_weight_group: no weight group joined")
        wire = manifest_to_wire(manifest)
        try:
            self.check_weights_manifest(manifest)
        except StateDictMismatchError:
            self._rpc("kpo_receive_weights", wire, "drain")
            raise
        if not apply:
            self._rpc("kpo_receive_weights", wire, "stage")
            self._staged_version = manifest.version
            return
        with self._generation_paused():
            self._torn_version = manifest.version
            self._rpc("kpo_receive_weights", wire, "apply")
            self._loaded(manifest.version)
        self._staged_version = None  # the workers dropped it: older than what is loaded

    @property
    def staged_version(self) -> int | None:
        """Version of the weights received with apply=False and not yet applied, if any."""
        return self._staged_version

    def apply_staged(self) -> None:
        """Load the weights the workers staged (`receive_weights(apply=False)`), set the version."""
        version = self._staged_version
        if version is None:
            raise RuntimeError("apply_staged: no weights were staged by receive_weights")
        with self._generation_paused():
            self._torn_version = version
            self._rpc("kpo_apply_staged", version)
            self._loaded(version)
        self._staged_version = None

    def close(self) -> None:
        """Shut the engine down, its processes included (and close the tool calls, as every
        backend does); the backend is unusable afterwards."""
        super().close()
        llm = self.__dict__.pop("_llm", None)
        if llm is not None:
            engine_core = getattr(llm.llm_engine, "engine_core", None)
            if engine_core is not None:
                engine_core.shutdown()


def _external_id(request_id: str) -> str:
    """The id outputs carry for a request `LLM.enqueue` added as `request_id`.

    `enqueue` names requests with a counter ("17") and returns vLLM's internal id, which is
    that name plus "-" and a random suffix ("17-3fa9c2d1"), or the name alone where vLLM's id
    randomisation is turned off; outputs carry the name.
    """
    return request_id.partition("-")[0]


def _logprobs_asked(sampling: SamplingSettings, vocab_size: int) -> int:
    """How many top log-probs to ask vLLM for per token: none beyond the sampled token's, or,
    where kept sets are recorded, one more than the largest set recordable (`_kept_sets`)."""
    limit = sampling.replay_max_kept
    if limit is None:
        return 0
    if sampling.top_k > 0:  # top-k keeps k ids (and ties with the k-th, which are rare)
        limit = min(limit, sampling.top_k)
    return min(limit + 1, vocab_size)


def _kept_sets(
    output: CompletionOutput,
    token_ids: Sequence[int],
    sampling: SamplingSettings,
    greedy: bool,
    vocab_size: int,
) -> list[list[int]] | None:
    """Per sampled token, the ids its processed distribution kept (finite log-prob, ascending),
    or [] over the limit: more than `replay_max_kept` ids, or every id asked for finite (the set
    may be larger than what was returned). None where the request records no sets. A greedy
    token's set is itself."""
    limit = sampling.replay_max_kept
    if limit is None:
        return None
    if greedy:
        return [[token] for token in token_ids]
    asked = _logprobs_asked(sampling, vocab_size)
    logprobs = output.logprobs
    if logprobs is None or len(logprobs) != len(token_ids):
        raise RuntimeError("vLLM returned no log-probs for some sampled tokens")
    sets: list[list[int]] = []
    for entry in logprobs:
        # The sampled token's entry comes besides the top ones where it is not one of them.
        finite = sorted(
            token
            for token, value in entry.items()
            if value.rank is not None and value.rank <= asked and math.isfinite(value.logprob)
        )
        whole = len(finite) < asked or asked == vocab_size
        sets.append(finite if whole and len(finite) <= limit else [])
    return sets


def _token_versions(output: CompletionOutput, count: int, submitted: int) -> list[int]:
    """The version that sampled each of `count` tokens, from vLLM's weight-version spans."""
    spans = output.weight_versions
    if not spans:
        if count:
            raise RuntimeError("vLLM reported no weight version for sampled tokens")
        return []
    versions: list[int] = []
    for span in spans:
        versions.extend([int(span.version)] * (span.end - span.start))
    if len(versions) != count:
        raise RuntimeError(f"vLLM's weight-version spans cover {len(versions)} of {count} tokens")
    if versions[0] < submitted:
        raise RuntimeError(f"token sampled by version {versions[0]}, submitted under {submitted}")
    return versions


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
