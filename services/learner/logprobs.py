"""Log-probs of the sampled response tokens under the learner's current weights.

The logits are divided by the sampling temperature before the softmax, because the behaviour
log-probs were taken at that temperature (as verl does): with the weights that generated a batch
and temperature-only sampling (top_k 0, top_p 1), the result equals the behaviour log-probs up to
float32 summation order. Top-k / top-p truncation is reproduced only where each token's kept set
is given (`kept`: the log-prob over the renormalised kept set, as the sampler took it); without
it, against a truncated behaviour distribution the on-policy ratio is pi_T(y) / pi_trunc(y) <= 1,
not 1.

Memory and speed: the decoder runs once over the micro-batch (padded [B, P+T], or its rows
packed into one sequence without padding: `packed_attention`); only the hidden states of the
response positions (N of them) meet the head, through `vocab_chunked_logprobs`: chunks of
`chunk_tokens` positions times `vocab_chunk` vocabulary entries, each with its own log-sum-exp
(combined per position), recomputed in the backward, so neither pass holds more than
[chunk_tokens, vocab_chunk] float32 logits (an 8k-token row of a 152k vocabulary held 5 GB
unchunked).

Which positions are scored is known on the host (`TrainingBatch.response_lengths`): the indices
are built there and copied once, and no step here waits on the device for a value or a shape.

A position whose logits hold NaN or +inf gets log-prob NaN and passes no gradient to the other
tokens: the loss then masks and counts that token like any other non-finite log-prob
(docs/numerics.md).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from kpo_core.losses import token_entropy
from services.learner.batch import TrainingBatch
from services.learner.packed_attention import PACKED_ROWS, PackedRows
from services.learner.vocab_kernels import LogprobKernel
from services.learner.vocab_logprobs import kept_mask, taken_outside, vocab_chunked_logprobs
from services.model_layout import ModelLayout

# Packed sequences are padded to a multiple of this many tokens, and the longest row rounded up
# to a power of two, when the decoder layers are compiled: a few distinct shapes, not one per
# micro-batch, so compiled code is reused instead of recompiled.
COMPILED_LENGTH_MULTIPLE = 256


def decoder_of(policy: nn.Module) -> nn.Module:
    """The decoder stack of a Hugging Face causal LM, under its output head: `get_decoder()`,
    or the LM's `model` where that answers the LM itself (Llama 4, whose base-model prefix names
    no attribute)."""
    decoder: nn.Module = policy.get_decoder()  # type: ignore[operator]
    inner = getattr(decoder, "model", None)
    if decoder.get_output_embeddings() is not None and isinstance(inner, nn.Module):  # type: ignore[operator]
        return inner
    return decoder


class SoftCappedHead(nn.Module):
    """An output head whose logits are soft-capped, cap * tanh(l / cap), as the family's
    causal-LM class caps them (Gemma 2's final_logit_softcapping)."""

    def __init__(self, head: nn.Module, cap: float) -> None:
        super().__init__()
        self.head = head
        self.cap = cap

    def forward(self, hidden: Tensor) -> Tensor:
        logits: Tensor = self.head(hidden)
        return self.cap * torch.tanh(logits / self.cap)


def chunk_logprobs(
    hidden: Tensor,
    head: nn.Module,
    targets: Tensor,
    temperature: float,
    with_entropy: bool,
    kept: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """log pi(target) and (if asked, detached) entropy of one chunk of positions, through the
    head module with [n, V] logits at once: the path for a head that is not a plain linear
    layer (an adapter-wrapped or soft-capped one), and the reference `vocab_chunked_logprobs`
    is tested against.

    hidden [n, H] in the compute dtype; targets [n] int64. Returns logp [n] float32 (NaN where
    the position's logits are not finite) and entropy [n] float32 (zeros unless with_entropy):

        logp = l[y] - logsumexp_v l[v],   l = head(hidden).float() / temperature

    With `kept` [n, K] (each position's kept set of truncated sampling, ids padded with -1), v
    runs over the kept set only, as in `vocab_chunked_logprobs`: NaN where y is not in it, and
    the entropy stays the full vocabulary's.
    """
    logits = head(hidden)
    # float32 at least (float64 stays float64: the equivalence tests run in it).
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32)) / temperature  # [n, V]
    # log Z is NaN or inf exactly when a logit of the position is NaN or +inf (or all are -inf).
    bad = ~torch.isfinite(torch.logsumexp(logits, dim=-1))
    if kept is not None:
        bad = bad | taken_outside(kept, targets)
    # where(), not a product: the gradient of the replaced logits is exactly 0, not 0 * NaN.
    logits = torch.where(bad.unsqueeze(-1), 0.0, logits)
    scored = logits if kept is None else _restricted(logits, kept, bad)
    log_z = torch.logsumexp(scored, dim=-1)
    chosen = scored.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    logp = torch.where(bad, torch.nan, chosen - log_z)
    if with_entropy:
        with torch.no_grad():
            entropy = token_entropy(logits.detach())
    else:
        entropy = torch.zeros_like(log_z).detach()
    return logp, entropy


def _restricted(logits: Tensor, kept: Tensor, bad: Tensor) -> Tensor:
    """The logits [n, V] at -inf outside each position's kept set; a `bad` position's (zeros)
    are left whole, so that no row is all -inf (its softmax, in the backward, would be NaN)."""
    keep = kept_mask(kept, 0, logits.shape[-1]) | bad.unsqueeze(-1)
    return torch.where(keep, logits, -torch.inf)


def _spans(starts: Sequence[int], lengths: Sequence[int]) -> Tensor:
    """The concatenated ranges [s, s + n) of every (s, n), as a host int64 tensor."""
    start = torch.tensor(starts, dtype=torch.long)
    length = torch.tensor(lengths, dtype=torch.long)
    offsets = torch.cumsum(length, 0) - length
    total = int(sum(lengths))
    return torch.arange(total) + torch.repeat_interleave(start - offsets, length, output_size=total)


def _to_device(index: Tensor, device: torch.device) -> Tensor:
    """A host index tensor on `device`, copied without making the host wait."""
    if device.type == "cuda":
        index = index.pin_memory()
    return index.to(device, non_blocking=True)


class ResponseLogProbs(nn.Module):
    """A causal LM seen as the function batch -> (response log-probs, token entropy).

    Wrapping the model makes this the one forward the learner calls: under FSDP2 the wrapper is
    the root module, so the embedding, final norm and output head (the root's parameters) are
    gathered for exactly this forward and its backward, and the chunked head runs inside it.
    `policy` is the Hugging Face model, whose parameter names the checkpoints keep.

    `packed`: a micro-batch's rows are concatenated without padding (`_hidden`); the policy must
    then attend within each row: loaded with `packed_attention.LEARNER_ATTENTION`, or with
    flash-attention (`flash`: it takes the rows' boundaries as keyword arguments). Padded, the
    policy is loaded with `LEARNER_ATTENTION` too (eager where its family does not run under
    SDPA): it then builds no mask of its own.
    `compiled`: the decoder layers are compiled, so packed lengths are rounded to few sizes.

    Every layer gets the mask its family takes (`services.model_layout`): padded, a mask per
    layer type (causal, sliding window, chunks) built with transformers' mask functions, handed
    over as one tensor to a decoder with one layer type and as a mapping keyed by type to a
    hybrid one (hybrid decoders are the ones that take a mapping); packed, the rows' boundaries
    and the layout, from which each layer takes its own.
    """

    def __init__(
        self,
        policy: nn.Module,
        chunk_tokens: int,
        vocab_chunk: int = 32_768,
        packed: bool = False,
        flash: bool = False,
        compiled: bool = False,
        layout: ModelLayout | None = None,
        kernel: LogprobKernel = "auto",
    ) -> None:
        super().__init__()
        self.policy = policy
        self.chunk_tokens = chunk_tokens
        self.vocab_chunk = vocab_chunk
        self.kernel: LogprobKernel = kernel
        self.packed = packed
        self.flash = flash
        self.compiled = compiled
        # As the builder read it already, else from the policy's config.
        self.layout = layout or ModelLayout.of(policy.config)  # type: ignore[arg-type]

    def forward(
        self,
        batch: TrainingBatch,
        temperature: float,
        with_entropy: bool,
        kept: Tensor | None = None,
    ) -> tuple[Tensor, Tensor]:
        """logp [B, T] float32 (float64 for a float64 model; 0 off the response mask, NaN
        where the logits are not finite) and entropy [B, T] float32 (detached; 0 off the
        mask, and everywhere unless `with_entropy`). Differentiable in the policy's
        parameters when grad is enabled. `kept` [B, T, K]: each response token's kept set of
        truncated sampling (ids padded with -1), over which alone its log-prob is taken
        (`vocab_chunked_logprobs`); None, the full vocabulary."""
        mask = batch.response_mask
        hidden, scored = self._hidden(batch)  # [X, H]; host indices of the scored states
        width = batch.response_width
        rows = range(batch.num_rows)
        lengths = batch.response_lengths
        # Every response token is scored, masked or not (the mask is applied to the result):
        # which tokens are masked is device data, how many tokens there are is host data.
        slots = _to_device(_spans([r * width for r in rows], lengths), batch.device)
        if not slots.numel():
            # With no response token at all (empty responses), one ghost position keeps the
            # head in the graph with a zero gradient: every rank of an FSDP group must reduce
            # the same gradients, whatever its rows.
            states, targets, kept = hidden[-1:], batch.input_ids[:1, -1], None
        else:
            states = hidden.index_select(0, _to_device(scored, batch.device))
            targets = batch.response_ids.flatten().index_select(0, slots)
            kept = None if kept is None else kept.flatten(0, 1).index_select(0, slots)
        logp, entropy = self._score(states, targets, temperature, with_entropy, kept)
        zeros = torch.zeros(mask.shape, dtype=logp.dtype, device=logp.device)
        if not slots.numel():
            # where(), not a product: the ghost's log-prob may be NaN.
            never = torch.zeros((), dtype=torch.bool, device=logp.device)
            return zeros + torch.where(never, logp.sum(), 0.0), zeros.float()
        flat = zeros.flatten()
        logp_out = flat.index_copy(0, slots, logp).view(mask.shape)
        entropy = entropy.detach().float()  # a metric: float32 whatever the compute dtype
        entropy_out = flat.detach().float().index_copy(0, slots, entropy).view(mask.shape)
        return torch.where(mask, logp_out, 0.0), torch.where(mask, entropy_out, 0.0)

    def _score(
        self,
        states: Tensor,
        targets: Tensor,
        temperature: float,
        with_entropy: bool,
        kept: Tensor | None = None,
    ) -> tuple[Tensor, Tensor]:
        """(logp [N], entropy [N]) of the scored states through the output head, with the
        family's logit transforms: a scale folds into the temperature (l m / T = l / (T / m)),
        a soft-cap takes the head module path."""
        head = self.policy.get_output_embeddings()  # type: ignore[operator]
        temperature = temperature / self.layout.logit_multiplier
        if self.layout.final_softcap is not None:
            head = SoftCappedHead(head, self.layout.final_softcap)
        elif type(head) is nn.Linear:
            return vocab_chunked_logprobs(
                states, head.weight, head.bias, targets, temperature,
                self.chunk_tokens, self.vocab_chunk, with_entropy, self.kernel, kept,
            )  # fmt: skip
        parts_logp, parts_entropy = [], []
        for start in range(0, int(targets.shape[0]), self.chunk_tokens):
            end = start + self.chunk_tokens
            part = None if kept is None else kept[start:end]
            args = (states[start:end], head, targets[start:end], temperature, with_entropy, part)
            if torch.is_grad_enabled():
                # The chunk's [n, V] logits are recomputed in the backward, not kept.
                logp, entropy = checkpoint(chunk_logprobs, *args, use_reentrant=False)
            else:
                logp, entropy = chunk_logprobs(*args)
            parts_logp.append(logp)
            parts_entropy.append(entropy)
        return torch.cat(parts_logp), torch.cat(parts_entropy).detach()

    def _hidden(self, batch: TrainingBatch) -> tuple[Tensor, Tensor]:
        """The decoder's last hidden states as rows [X, H], and the host indices [N] of the
        states that predict the response tokens, row by row (row r's slot j is predicted by
        its column P - 1 + j).

        Padded: one forward over [B, P+T] with the attention mask (X = B (P+T)). Packed: the
        real tokens of every row concatenated into one sequence whose position ids restart at
        each row (X = the real tokens, plus a pad row when compiled).
        """
        decoder = decoder_of(self.policy)
        total, width_p = batch.input_ids.shape[1], batch.prompt_width
        prompts, responses = batch.prompt_lengths, batch.response_lengths
        rows = range(batch.num_rows)
        if not self.packed:
            hidden = decoder(
                input_ids=batch.input_ids,
                attention_mask=self._padded_mask(batch),
                position_ids=batch.position_ids,
                use_cache=False,
            ).last_hidden_state
            scored = _spans([r * total + width_p - 1 for r in rows], responses)
            return hidden.flatten(0, 1), scored
        lengths = [p + t for p, t in zip(prompts, responses, strict=True)]
        real = _spans(
            [r * total + width_p - p for r, p in zip(rows, prompts, strict=True)], lengths
        )
        offsets = [sum(lengths[:r]) for r in rows]
        scored = _spans([o + p - 1 for o, p in zip(offsets, prompts, strict=True)], responses)
        index = _to_device(real, batch.device)
        input_ids = batch.input_ids.flatten().index_select(0, index)
        position_ids = batch.position_ids.flatten().index_select(0, index)
        longest = 0
        if self.compiled:
            filler = -sum(lengths) % COMPILED_LENGTH_MULTIPLE
            if filler:
                lengths.append(filler)
                input_ids = torch.cat([input_ids, input_ids.new_zeros(filler)])
                position_ids = torch.cat(
                    [position_ids, torch.arange(filler, device=position_ids.device)]
                )
            longest = 1 << (max(lengths) - 1).bit_length()
        packed_rows = PackedRows.of(lengths, batch.device, self.layout, longest)
        extra: dict[str, Any] = {PACKED_ROWS: packed_rows}
        if self.flash:
            # transformers' flash-attention path reads the boundaries from these arguments
            # (and each layer's window from the layer itself).
            cumulative, longest_row = packed_rows.cumulative, packed_rows.longest
            extra = {
                "cu_seq_lens_q": cumulative,
                "cu_seq_lens_k": cumulative,
                "max_length_q": longest_row,
                "max_length_k": longest_row,
            }
        # No mask: the decoder, loaded with `LEARNER_ATTENTION`, builds none.
        hidden = decoder(
            input_ids=input_ids.unsqueeze(0),
            attention_mask=None,
            position_ids=position_ids.unsqueeze(0),
            use_cache=False,
            **extra,
        ).last_hidden_state[0]
        return hidden, scored

    def _padded_mask(self, batch: TrainingBatch) -> Tensor | dict[str, Tensor] | None:
        """The attention mask of a padded forward, built from host lengths.

        flash-attention: the 2-D mask, from which it builds its own (windows included). No row
        padded and no window narrower than the rows, under SDPA: no mask (plain causal
        attention, SDPA's fastest kernels; the decoder, loaded with `LEARNER_ATTENTION`, builds
        none). Else each layer type's mask (`ModelLayout.padded_masks`), additive for eager
        attention (which masks only what it is given): one tensor for a decoder of one layer
        type, a mapping keyed by type for a hybrid one.
        """
        if self.flash:
            return batch.attention_mask
        total, width_p = batch.input_ids.shape[1], batch.prompt_width
        implementation = self.policy.config._attn_implementation  # type: ignore[union-attr]
        eager = implementation == "eager"
        full = all(p == width_p for p in batch.prompt_lengths) and all(
            width_p + t == total for t in batch.response_lengths
        )
        if full and not eager and not any(kind.binds(total) for kind in self.layout.layers):
            return None
        real = batch.attention_mask.bool()
        left = [width_p - p for p in batch.prompt_lengths]
        left_padding = _to_device(torch.tensor(left, dtype=torch.long), batch.device)
        additive = next(self.policy.parameters()).dtype if eager else None
        masks = self.layout.padded_masks(real, left_padding, additive)
        return masks if self.layout.hybrid else next(iter(masks.values()))


def response_logprobs(
    model: ResponseLogProbs, batch: TrainingBatch, temperature: float, with_entropy: bool
) -> tuple[Tensor, Tensor | None]:
    """`model(batch, ...)`: logp [B, T] and, with `with_entropy`, the entropy [B, T] (else None).
    A batch with kept sets (`TrainingBatch.kept`) is scored over them: truncated sampling
    replayed, so that logp is of the distribution the behaviour log-probs are of."""
    logp, entropy = model(batch, temperature, with_entropy, kept=batch.kept)
    return logp, entropy if with_entropy else None


@torch.no_grad()
def reference_logprobs(
    model: ResponseLogProbs,
    batch: TrainingBatch,
    temperature: float,
    parts: Sequence[Sequence[int]],
) -> Tensor:
    """`response_logprobs` without gradient, [B, T], computed one row set of `parts` (host
    row indices) at a time.

    Used for the proximal log-probs at the start of a step; `parts` are the micro-batches'
    rows, so the activation memory is that of one micro-batch.
    """
    out = torch.zeros(batch.response_mask.shape, dtype=torch.float32, device=batch.device)
    for rows in parts:
        part = batch.select(rows).cropped()
        logp, _ = response_logprobs(model, part, temperature, False)
        index = _to_device(torch.tensor(list(rows), dtype=torch.long), batch.device)
        out[index, : part.response_width] = logp
    return out
