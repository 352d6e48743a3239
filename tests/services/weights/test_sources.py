"""Which copy of a version a new worker asks first (services/weights/sources.py): a peer on its
own node while the learner is on another; the learner's wherever it is as near."""

from __future__ import annotations

from services.weights.sources import nearer_peers


def test_peers_on_the_workers_node_come_first_when_the_learner_is_elsewhere() -> None:
    assert nearer_peers("b", "a", ["b", "c", "b"]) == [0, 2]  # in the order named


def test_the_learner_on_the_workers_node_is_asked_first() -> None:
    assert nearer_peers("a", "a", ["a", "b"]) == []


def test_peers_on_other_nodes_are_no_nearer_than_the_learner() -> None:
    assert nearer_peers("c", "a", ["a", "b"]) == []


def test_a_source_that_did_not_say_its_node_counts_as_elsewhere() -> None:
    assert nearer_peers("b", None, [None, "b"]) == [1]  # the learner's node unknown
