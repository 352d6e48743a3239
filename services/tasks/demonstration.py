"""Warm-start demonstrations made of segments: what the model writes, and what it only reads.

A demonstration of a tool-using response alternates the model's own text (trained on) with the
tool's observations (context only). An observation's tokens get no loss, as in RL: the model
must learn to read a tool's output, never to write one itself. Plain string demonstrations are
all model text.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Segment:
    """A piece of a demonstration; `observation`: the tool's output (no loss on its tokens)."""

    text: str
    observation: bool = False


# A demonstration: a string (all model text), or segments in order.
Demonstration = str | Sequence[Segment]


def segments_of(demonstration: Demonstration) -> list[Segment]:
    """The segments of `demonstration` (a string is one model segment)."""
    if isinstance(demonstration, str):
        return [Segment(demonstration)]
    return list(demonstration)


def demonstration_text(demonstration: Demonstration) -> str:
    """The whole text of `demonstration`, observations included."""
    return "".join(segment.text for segment in segments_of(demonstration))
