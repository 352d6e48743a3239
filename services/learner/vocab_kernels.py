"""The elementwise work of one [positions, vocabulary] block of the log-prob head, apart from its
matrix products: what `vocab_logprobs` runs eagerly (`logprob_kernel: torch`) or compiled
(`compiled`; `auto` picks compiled on CUDA when the compiler works, else eager).

Each function reads its block of logits once as far as eager kernels allow, and writes at most
one block: the forward's statistics come out of one softmax (whose largest entry is 1 / sum of
e^(l - max), so the block's log-sum-exp needs no separate exp pass), and the backward's
d logp / d l is that same softmax, its per-row scale folded into the small matrices around the
products instead of into the block.

With a kept set (truncated sampling replayed: `kept_block_stats`, `kept_block_probs`), the
block's logits outside the set are set to FLOOR before the same softmax, so that its
log-sum-exp and softmax are those of the kept ids only.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Literal

import torch
from torch import Tensor

log = logging.getLogger(__name__)

LogprobKernel = Literal["auto", "torch", "compiled"]
BlockStats = Callable[[Tensor, float, bool], tuple[Tensor, Tensor]]
BlockProbs = Callable[[Tensor, float, torch.dtype, torch.dtype], Tensor]
KeptBlockStats = Callable[[Tensor, Tensor, float, bool], tuple[Tensor, Tensor, Tensor]]
KeptBlockProbs = Callable[[Tensor, Tensor, float, torch.dtype, torch.dtype], Tensor]

# -inf biases (divided by the temperature) are raised to this, and the logits of ids outside a
# kept set are set to it: with no -inf logit, no block's softmax is NaN (a block all -inf would
# be, and 0 x NaN is NaN in the products) and the entropy's sum p l has no 0 x -inf.
# e^(FLOOR - anything finite) is exactly 0, so no value changes.
FLOOR = -1e30


def scaled_logits(z: Tensor, scale: float, accumulate: torch.dtype) -> Tensor:
    """The block's logits in the accumulation dtype: z (the product, maybe in a lower compute
    dtype) times 1 / temperature. Neither step is a pass where nothing changes (float32 with the
    temperature folded into the product's operands)."""
    if z.dtype == accumulate:
        return z if scale == 1.0 else z * scale
    # In place on the fresh cast: one block, not two.
    logits = z.to(accumulate)
    return logits if scale == 1.0 else logits.mul_(scale)


def block_stats(z: Tensor, scale: float, with_entropy: bool) -> tuple[Tensor, Tensor]:
    """(log-sum-exp [c], entropy of the block's own softmax [c]) of one block; zeros for the
    entropy without `with_entropy`. The logits must be finite or NaN (the caller raises -inf
    biases to a floor): a -inf logit would make p l = 0 x -inf."""
    accumulate = torch.promote_types(z.dtype, torch.float32)
    logits = scaled_logits(z, scale, accumulate)
    top = logits.amax(-1)
    probs = torch.softmax(logits, -1)
    # max softmax = e^0 / sum e^(l - top): log Z of the block without another exp pass.
    lse = top - probs.amax(-1).log()
    if not with_entropy:
        return lse, torch.zeros_like(lse)
    # H = lse - sum p l, the product in place of p (the block is not needed again). Not
    # -sum p log p: a log per element was most of the CPU step. The difference loses about
    # |l| x 1e-7 to rounding; the entropy is a metric.
    return lse, lse - probs.mul_(logits).sum(-1)


def block_probs(z: Tensor, scale: float, accumulate: torch.dtype, out: torch.dtype) -> Tensor:
    """The block's own softmax, in `out` (the dtype of the products it enters)."""
    return torch.softmax(scaled_logits(z, scale, accumulate), -1).to(out)


def kept_block_stats(
    z: Tensor, keep: Tensor, scale: float, with_entropy: bool
) -> tuple[Tensor, Tensor, Tensor]:
    """(log-sum-exp over the block's kept ids [c], the block's full log-sum-exp [c], the entropy
    of its full softmax [c]) of one block whose ids in each position's kept set are `keep`
    [c, width]; the last two zeros without `with_entropy`. A block with no kept id has a kept
    log-sum-exp of FLOOR or -inf: it adds nothing to log Z.

    A NaN or +inf logit anywhere in the block, kept or not, makes the kept log-sum-exp NaN: the
    position is non-finite, as it is without a kept set (the mask alone would hide it)."""
    logits = scaled_logits(z, scale, torch.promote_types(z.dtype, torch.float32))
    top = logits.amax(-1)  # NaN or +inf where any logit is (all -inf too: -inf - -inf)
    if not with_entropy:
        kept_lse, _ = block_stats(torch.where(keep, logits, FLOOR), 1.0, False)
        zeros = torch.zeros_like(kept_lse)
        return kept_lse + (top - top), zeros, zeros
    # With the entropy (the full vocabulary's, see vocab_logprobs) the block's full softmax is
    # taken anyway, and the kept log-sum-exp is the full one plus the log of the kept ids' share
    # of it: one softmax, not two. A kept id whose share underflows (more than about 87 nats
    # below the block's most likely id, and so below the set's own most likely one, which a
    # sampler always keeps) is lost only where it would be lost to rounding anyway.
    probs = torch.softmax(logits, -1)
    lse = top - probs.amax(-1).log()
    kept_lse = lse + torch.where(keep, probs, 0.0).sum(-1).log()
    return kept_lse, lse, lse - probs.mul_(logits).sum(-1)


def kept_block_probs(
    z: Tensor, keep: Tensor, scale: float, accumulate: torch.dtype, out: torch.dtype
) -> Tensor:
    """The block's softmax over its kept ids `keep` [c, width] (exactly 0 at the others; uniform
    where the block has no kept id, which its share of 0 then cancels), in `out`."""
    logits = scaled_logits(z, scale, accumulate)
    return torch.softmax(torch.where(keep, logits, FLOOR), -1).to(out)


class _Kernels:
    """The eager functions and, once asked for, their compiled versions."""

    def __init__(self) -> None:
        self.compiled: tuple[BlockStats, BlockProbs] | None = None
        self.compiled_kept: tuple[KeptBlockStats, KeptBlockProbs] | None = None
        # (device type, dtype, scale, kept) -> auto's probe compiled and ran there
        self.auto_works: dict[tuple[str, torch.dtype, float, bool], bool] = {}

    def get(
        self, kernel: LogprobKernel, device: torch.device, dtype: torch.dtype, scale: float
    ) -> tuple[BlockStats, BlockProbs]:
        """The functions for blocks of products in `dtype` at `scale` (1 / temperature)."""
        if self._eager(kernel, device, dtype, scale, kept=False):
            return block_stats, block_probs
        return self._compiled()

    def get_kept(
        self, kernel: LogprobKernel, device: torch.device, dtype: torch.dtype, scale: float
    ) -> tuple[KeptBlockStats, KeptBlockProbs]:
        """`get`'s, for blocks restricted to kept sets."""
        if self._eager(kernel, device, dtype, scale, kept=True):
            return kept_block_stats, kept_block_probs
        return self._compiled_kept()

    def _eager(
        self,
        kernel: LogprobKernel,
        device: torch.device,
        dtype: torch.dtype,
        scale: float,
        kept: bool,
    ) -> bool:
        return kernel == "torch" or (
            kernel == "auto" and not self._auto_compiles(device, dtype, scale, kept)
        )

    def _compiled(self) -> tuple[BlockStats, BlockProbs]:
        if self.compiled is None:
            # dynamic=None: the last position chunk and vocabulary block have other sizes;
            # after the first such recompile the sizes are symbolic.
            self.compiled = (torch.compile(block_stats), torch.compile(block_probs))
        return self.compiled

    def _compiled_kept(self) -> tuple[KeptBlockStats, KeptBlockProbs]:
        if self.compiled_kept is None:
            self.compiled_kept = (torch.compile(kept_block_stats), torch.compile(kept_block_probs))
        return self.compiled_kept

    def _auto_compiles(
        self, device: torch.device, dtype: torch.dtype, scale: float, kept: bool
    ) -> bool:
        """auto: CUDA only, and only if both functions compile and run there on blocks of the
        run's dtype and scale (once per process and setting: a missing Triton or compiler, or
        a dtype the GPU's kernels lack, must not fail a run that eager code would serve; a
        probe in another dtype would compile other kernels than the run's)."""
        if device.type != "cuda":
            return False
        key = (device.type, dtype, scale, kept)
        if key not in self.auto_works:
            try:
                self._probe(device, dtype, scale, kept)
                self.auto_works[key] = True
            except Exception as error:  # any compiler failure means eager
                log.warning("logprob_kernel auto: the compiled head failed (%s); eager", error)
                self.auto_works[key] = False
        return self.auto_works[key]

    def _probe(self, device: torch.device, dtype: torch.dtype, scale: float, kept: bool) -> None:
        """Both compiled functions (kept or not) once on a small block."""
        probe = torch.zeros(2, 8, device=device, dtype=dtype)
        accumulate = torch.promote_types(dtype, torch.float32)
        if kept:
            keep = torch.ones(2, 8, device=device, dtype=torch.bool)
            kept_stats, kept_probs = self._compiled_kept()
            kept_stats(probe, keep, scale, True)
            kept_probs(probe, keep, scale, accumulate, dtype)
            return
        stats, probs = self._compiled()
        stats(probe, scale, True)
        probs(probe, scale, accumulate, dtype)


KERNELS = _Kernels()
