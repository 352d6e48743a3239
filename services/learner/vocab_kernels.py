"""The elementwise work of one [positions, vocabulary] block of the log-prob head, apart from its
matrix products: what `vocab_logprobs` runs eagerly (`logprob_kernel: torch`) or compiled
(`compiled`; `auto` picks compiled on CUDA when the compiler works, else eager).

Each function reads its block of logits once as far as eager kernels allow, and writes at most
one block: the forward's statistics come out of one softmax (whose largest entry is 1 / sum of
e^(l - max), so the block's log-sum-exp needs no separate exp pass), and the backward's
d logp / d l is that same softmax, its per-row scale folded into the small matrices around the
products instead of into the block.
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


def _logits(z: Tensor, scale: float, accumulate: torch.dtype) -> Tensor:
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
    logits = _logits(z, scale, accumulate)
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
    return torch.softmax(_logits(z, scale, accumulate), -1).to(out)


class _Kernels:
    """The eager functions and, once asked for, their compiled versions."""

    def __init__(self) -> None:
        self.compiled: tuple[BlockStats, BlockProbs] | None = None
        # (device type, dtype, scale) -> auto's probe compiled and ran there
        self.auto_works: dict[tuple[str, torch.dtype, float], bool] = {}

    def get(
        self, kernel: LogprobKernel, device: torch.device, dtype: torch.dtype, scale: float
    ) -> tuple[BlockStats, BlockProbs]:
        """The functions for blocks of products in `dtype` at `scale` (1 / temperature)."""
        if kernel == "torch" or (
            kernel == "auto" and not self._auto_compiles(device, dtype, scale)
        ):
            return block_stats, block_probs
        return self._compiled()

    def _compiled(self) -> tuple[BlockStats, BlockProbs]:
        if self.compiled is None:
            # dynamic=None: the last position chunk and vocabulary block have other sizes;
            # after the first such recompile the sizes are symbolic.
            self.compiled = (torch.compile(block_stats), torch.compile(block_probs))
        return self.compiled

    def _auto_compiles(self, device: torch.device, dtype: torch.dtype, scale: float) -> bool:
        """auto: CUDA only, and only if both functions compile and run there on blocks of the
        run's dtype and scale (once per process and setting: a missing Triton or compiler, or
        a dtype the GPU's kernels lack, must not fail a run that eager code would serve; a
        probe in another dtype would compile other kernels than the run's)."""
        if device.type != "cuda":
            return False
        key = (device.type, dtype, scale)
        if key not in self.auto_works:
            stats, probs = self._compiled()
            probe = torch.zeros(2, 8, device=device, dtype=dtype)
            accumulate = torch.promote_types(dtype, torch.float32)
            try:
                stats(probe, scale, True)
                probs(probe, scale, accumulate, dtype)
                self.auto_works[key] = True
            except Exception as error:  # any compiler failure means eager
                log.warning("logprob_kernel auto: the compiled head failed (%s); eager", error)
                self.auto_works[key] = False
        return self.auto_works[key]


KERNELS = _Kernels()
