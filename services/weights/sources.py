"""Where a generation worker gets a version whole when it cannot apply a delta offer (it is new,
missed a version, or a patch failed its digest): from learner rank 0's copy, or from a surviving
worker's, which the driver names in the offer (`WeightsOffer.peers`, for a replacement or a
worker added to the pool).

A peer is asked first when it is nearer: on the worker's node while the learner is on another.
Both put the version whole into the object store of their own node (`put_dense`); the worker
then maps a peer's objects from its node's shared memory, while the learner's cross the network
and its put takes the learner's process and memory bandwidth beside training. Where the learner
shares the worker's node, its copy is as near and is the one asked (it is the version's source).
A peer that no longer holds the version (it loaded a newer one, or has not loaded this one yet),
died, or does not answer in time is passed over for the next source.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import ray
from ray.exceptions import RayError

from services.weights.base import WeightsOffer

log = logging.getLogger(__name__)

# How long a worker waits for its sources to say which node they are on (a hung one is passed
# over: the learner's copy is always asked last).
NODE_QUERY_TIMEOUT_S = 10.0

SourceKind = Literal["peer", "learner"]


@dataclass(frozen=True)
class WholeSource:
    """One holder of a version whole: an actor that answers `dense_offer(at_least)`."""

    kind: SourceKind
    actor: Any


def nearer_peers(
    here: str, learner_node: str | None, peer_nodes: Sequence[str | None]
) -> list[int]:
    """Which peers (by index) to ask before the learner: those on this worker's node `here`,
    in the given order, unless the learner is on it too (None: a node that did not answer)."""
    if learner_node == here:
        return []
    return [index for index, node in enumerate(peer_nodes) if node == here]


def whole_sources(offer: WeightsOffer) -> list[WholeSource]:
    """The sources to ask for `offer`'s version whole, nearest first, the learner last."""
    learner = WholeSource("learner", offer.source)
    if not offer.peers:
        return [learner]
    holders = [offer.source, *offer.peers]
    nodes = _nodes_of(holders)
    here = ray.get_runtime_context().get_node_id()
    chosen = nearer_peers(here, nodes[0], nodes[1:])
    return [*(WholeSource("peer", offer.peers[i]) for i in chosen), learner]


def _nodes_of(actors: Sequence[Any]) -> list[str | None]:
    """The node each actor runs on; None for one that died or did not answer in time."""
    refs = [actor.__ray_call__.remote(_node_id) for actor in actors]
    ready, _ = ray.wait(refs, num_returns=len(refs), timeout=NODE_QUERY_TIMEOUT_S)
    answered = set(ready)
    nodes: list[str | None] = []
    for ref in refs:
        node = None
        if ref in answered:
            try:
                node = str(ray.get(ref))
            except RayError as error:
                log.info("a holder of the weights did not say its node: %s", error)
        nodes.append(node)
    return nodes


def _node_id(_actor: Any) -> str:
    return ray.get_runtime_context().get_node_id()


__all__ = ["NODE_QUERY_TIMEOUT_S", "WholeSource", "nearer_peers", "whole_sources"]
