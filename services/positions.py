"""Token positions of left-padded rows, one definition for the two sides that must agree.

The `hf` generation backend samples each token with these positions and the learner recomputes
its log-prob with them: with the same weights the two log-probs are equal only if the positions
are (tests/services/learner). Both import them from here, neither from the other.
"""

from __future__ import annotations

import torch


def position_ids_for(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions counted from each row's first real token, so left padding does not shift them.

    Padding slots get position 0; they are masked out, so their value never matters. (Rotary
    models only see position differences within a row, but the prefill and every decode step
    must agree on them, and models with absolute positions see the values themselves.)
    """
    return (attention_mask.cumsum(dim=-1) - 1).clamp(min=0)
