"""Log-probs of the sampled response tokens under the learner's current weights.

The logits are divided by the sampling temperature before the softmax, because the behaviour
log-probs were taken at that temperature (as verl does): with the weights that generated a batch
and temperature-only sampling (top_k 0, top_p 1), the result equals the behaviour log-probs up to
float32 summation order. Top-k / top-p truncation is NOT reproduced: against a truncated
behaviour distribution the on-policy ratio is pi_T(y) / pi_trunc(y) <= 1, not 1.

A position whose logits hold NaN or +inf (an overflow, a poisoned weight) gets log-prob NaN, and
its logits are replaced by zeros before the softmax, so that no NaN reaches the gradient of the
other tokens: the loss then masks and counts that token like any other non-finite log-prob
(docs/numerics.md).
"""

from __future__ import annotations

import torch
from torch import Tensor

from kpo_core.losses import token_entropy
from services.learner.batch import TrainingBatch


def response_logprobs(
    model: torch.nn.Module, batch: TrainingBatch, temperature: float, with_entropy: bool
) -> tuple[Tensor, Tensor | None]:
    """log pi(y_t | prompt, y_<t) of each response token, and optionally the token entropy.

    One forward over input_ids [B, P+T]; only the last T+1 positions are projected to the
    vocabulary (`logits_to_keep`), and the last of those (which predicts past the padded end)
    is dropped, leaving the logits at columns P-1 .. P+T-2 that predict response slots 0..T-1:

        logp[b, t] = (l[b, t, y_bt] - logsumexp_v l[b, t, v]),   l = logits / temperature

    computed in float32 whatever the model's dtype. Returns logp [B, T] float32 (differentiable,
    0 off the response mask, NaN where the position's logits are not finite) and, with
    `with_entropy`, the entropy of softmax(l) [B, T] float32 (detached: it is a metric; finite
    everywhere, meaningless where logp is NaN), else None.
    """
    width = batch.response_width
    output = model(
        input_ids=batch.input_ids,
        attention_mask=batch.attention_mask,
        position_ids=batch.position_ids,
        logits_to_keep=width + 1,
        use_cache=False,
    )
    logits = output.logits[:, :-1, :].float() / temperature  # [B, T, V]
    log_z = torch.logsumexp(logits, dim=-1)
    # log Z is NaN or inf exactly when a logit of the position is NaN or +inf (or all are -inf).
    bad = ~torch.isfinite(log_z)
    if bool(bad.any()):
        # where(), not a product: the gradient of the replaced logits is exactly 0, not 0 * NaN.
        logits = torch.where(bad.unsqueeze(-1), 0.0, logits)
        log_z = torch.logsumexp(logits, dim=-1)
    chosen = logits.gather(-1, batch.response_ids.unsqueeze(-1)).squeeze(-1)
    logp = torch.where(bad, torch.nan, chosen - log_z)
    logp = torch.where(batch.response_mask, logp, 0.0)
    entropy = None
    if with_entropy:
        with torch.no_grad():
            entropy = token_entropy(logits.detach())
    return logp, entropy


@torch.no_grad()
def reference_logprobs(
    model: torch.nn.Module, batch: TrainingBatch, temperature: float, chunks: int
) -> Tensor:
    """`response_logprobs` without gradient, [B, T], computed `chunks` row slices at a time.

    Used for the proximal log-probs at the start of a step; chunking bounds the activation
    memory to that of one minibatch.
    """
    parts = []
    for rows in torch.tensor_split(torch.arange(batch.num_rows), chunks):
        if rows.numel():
            logp, _ = response_logprobs(
                model, batch.select(rows.to(batch.input_ids.device)), temperature, False
            )
            parts.append(logp)
    return torch.cat(parts)
