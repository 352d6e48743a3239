"""Log-probs of the sampled response tokens under the learner's current weights, in chunks.

The logits are divided by the sampling temperature before the softmax, because the behaviour
log-probs were taken at that temperature (as verl does): with the weights that generated a batch
and temperature-only sampling (top_k 0, top_p 1), the result equals the behaviour log-probs up to
float32 summation order. Top-k / top-p truncation is NOT reproduced: against a truncated
behaviour distribution the on-policy ratio is pi_T(y) / pi_trunc(y) <= 1, not 1.

Memory: the decoder runs once over input_ids [B, P+T]; only the hidden states of the valid
response positions (N of them) are projected to the vocabulary, `chunk_tokens` positions at a
time, each chunk in float32 and under activation checkpointing, so neither the forward nor the
backward ever holds more than [chunk_tokens, V] float32 logits (an 8k-token row of a 152k
vocabulary: 5 GB at once unchunked, 0.6 GB per 1,024-token chunk).

A position whose logits hold NaN or +inf (an overflow, a poisoned weight) gets log-prob NaN, and
its logits are replaced by zeros before the softmax, so that no NaN reaches the gradient of the
other tokens: the loss then masks and counts that token like any other non-finite log-prob
(docs/numerics.md).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from kpo_core.losses import token_entropy
from services.learner.batch import TrainingBatch


def chunk_logprobs(
    hidden: Tensor, head: nn.Module, targets: Tensor, temperature: float, with_entropy: bool
) -> tuple[Tensor, Tensor]:
    """log pi(target) and (if asked, detached) entropy of one chunk of positions.

    hidden [n, H] in the compute dtype; targets [n] int64. Returns logp [n] float32 (NaN where
    the position's logits are not finite) and entropy [n] float32 (zeros unless with_entropy):

        logp = l[y] - logsumexp_v l[v],   l = head(hidden).float() / temperature
    """
    logits = head(hidden)
    # float32 at least (float64 stays float64: the equivalence tests run in it).
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32)) / temperature  # [n, V]
    log_z = torch.logsumexp(logits, dim=-1)
    # log Z is NaN or inf exactly when a logit of the position is NaN or +inf (or all are -inf).
    bad = ~torch.isfinite(log_z)
    if bool(bad.any()):
        # where(), not a product: the gradient of the replaced logits is exactly 0, not 0 * NaN.
        logits = torch.where(bad.unsqueeze(-1), 0.0, logits)
        log_z = torch.logsumexp(logits, dim=-1)
    chosen = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    logp = torch.where(bad, torch.nan, chosen - log_z)
    if with_entropy:
        with torch.no_grad():
            entropy = token_entropy(logits.detach())
    else:
        entropy = torch.zeros_like(log_z).detach()
    return logp, entropy


class ResponseLogProbs(nn.Module):
    """A causal LM seen as the function batch -> (response log-probs, token entropy).

    Wrapping the model makes this the one forward the learner calls: under FSDP2 the wrapper is
    the root module, so the embedding, final norm and output head (the root's parameters) are
    gathered for exactly this forward and its backward, and the chunked head runs inside it.
    `policy` is the Hugging Face model, whose parameter names the checkpoints keep. `packed`:
    rows are concatenated without padding (`_hidden`), for attention kernels that take
    variable-length rows (flash-attention).
    """

    def __init__(self, policy: nn.Module, chunk_tokens: int, packed: bool = False) -> None:
        super().__init__()
        self.policy = policy
        self.chunk_tokens = chunk_tokens
        self.packed = packed

    def forward(
        self, batch: TrainingBatch, temperature: float, with_entropy: bool
    ) -> tuple[Tensor, Tensor]:
        """logp [B, T] float32 (float64 for a float64 model; 0 off the response mask, NaN
        where the logits are not finite) and entropy [B, T] float32 (detached; 0 off the
        mask, and everywhere unless `with_entropy`). Differentiable in the policy's
        parameters when grad is enabled."""
        mask = batch.response_mask
        # With no response token to score (empty responses, a rank's filler pass), one ghost
        # position keeps the head in the graph with a zero gradient: every rank of an FSDP
        # group must reduce the same gradients, whatever its rows.
        ghost = not bool(mask.any())
        hidden, where = self._hidden(batch)  # [X, H]; where [B, P+T]: row of each token
        if ghost:
            states, targets = hidden[-1:], batch.input_ids[:1, -1]  # [1, H], [1]
        else:
            # Columns P-1 .. P+T-2 predict response slots 0 .. T-1.
            total, width = batch.input_ids.shape[1], batch.response_width
            scored = where[:, total - width - 1 : total - 1][mask]
            states, targets = hidden[scored], batch.response_ids[mask]  # [N, H], [N]
        head = self.policy.get_output_embeddings()  # type: ignore[operator]
        parts_logp, parts_entropy = [], []
        for start in range(0, int(targets.shape[0]), self.chunk_tokens):
            end = start + self.chunk_tokens
            args = (states[start:end], head, targets[start:end], temperature, with_entropy)
            if torch.is_grad_enabled():
                # The chunk's [n, V] logits are recomputed in the backward, not kept.
                logp, entropy = checkpoint(chunk_logprobs, *args, use_reentrant=False)
            else:
                logp, entropy = chunk_logprobs(*args)
            parts_logp.append(logp)
            parts_entropy.append(entropy)
        logp, entropy = torch.cat(parts_logp), torch.cat(parts_entropy).detach()
        zeros = torch.zeros(mask.shape, dtype=logp.dtype, device=logp.device)
        if ghost:
            # where(), not a product: the ghost's log-prob may be NaN.
            return zeros + torch.where(
                torch.zeros((), dtype=torch.bool, device=logp.device), logp.sum(), 0.0
            ), zeros
        entropy_out = torch.zeros_like(zeros, dtype=entropy.dtype).masked_scatter(mask, entropy)
        return zeros.masked_scatter(mask, logp), entropy_out

    def _hidden(self, batch: TrainingBatch) -> tuple[Tensor, Tensor]:
        """The decoder's last hidden states as rows [X, H], and for every (row, column) of the
        batch the index of its state there [B, P+T] (meaningful at real tokens only).

        Padded: one forward over [B, P+T] with the attention mask (X = B (P+T)). Packed: the
        real tokens of every row concatenated into one sequence whose position ids restart at
        each row (X = the real tokens): transformers then attends within each row only (with
        flash-attention, through its variable-length kernels, so padding costs nothing).
        """
        decoder = self.policy.get_decoder()  # type: ignore[operator]
        real = batch.attention_mask.bool()
        if self.packed and batch.num_rows > 1:
            hidden = decoder(
                input_ids=batch.input_ids[real].unsqueeze(0),
                position_ids=batch.position_ids[real].unsqueeze(0),
                use_cache=False,
            ).last_hidden_state[0]
            where = (real.flatten().cumsum(0) - 1).reshape(real.shape)
            return hidden, where
        hidden = decoder(
            input_ids=batch.input_ids,
            attention_mask=batch.attention_mask,
            position_ids=batch.position_ids,
            use_cache=False,
        ).last_hidden_state
        where = torch.arange(real.numel(), device=real.device).reshape(real.shape)
        return hidden.flatten(0, 1), where


def response_logprobs(
    model: ResponseLogProbs, batch: TrainingBatch, temperature: float, with_entropy: bool
) -> tuple[Tensor, Tensor | None]:
    """`model(batch, ...)`: logp [B, T] and, with `with_entropy`, the entropy [B, T] (else None)."""
    logp, entropy = model(batch, temperature, with_entropy)
    return logp, entropy if with_entropy else None


@torch.no_grad()
def reference_logprobs(
    model: ResponseLogProbs, batch: TrainingBatch, temperature: float, parts: list[Tensor]
) -> Tensor:
    """`response_logprobs` without gradient, [B, T], computed one row set of `parts` at a time.

    Used for the proximal log-probs at the start of a step; `parts` are the micro-batches'
    rows, so the activation memory is that of one micro-batch.
    """
    out = torch.zeros(batch.response_mask.shape, dtype=torch.float32, device=batch.device)
    for rows in parts:
        part = batch.select(rows).cropped()
        logp, _ = response_logprobs(model, part, temperature, False)
        out[rows, : part.response_width] = logp
    return out
