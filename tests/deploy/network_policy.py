"""What a set of NetworkPolicies admits, decided offline as Kubernetes defines it.

A pod is isolated for ingress once a policy with `Ingress` in its policyTypes selects it; then a
connection to it is admitted when a rule of one of those policies matches both the source (a
`from` peer, or no `from` at all) and the destination port (a `ports` entry, or none at all).
A peer with only `podSelector` means pods of the policy's namespace; with only
`namespaceSelector`, every pod of those namespaces; with both, the pods matching both. Ports
named in a policy resolve against the destination pod's container ports. Only TCP is modelled,
and `ipBlock` peers match no pod (they are for traffic from outside the cluster).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

Manifest = dict[str, Any]


@dataclass(frozen=True)
class Pod:
    """A pod as NetworkPolicies see it: where it is, its labels, its named ports."""

    name: str
    namespace: str
    labels: Mapping[str, str]
    namespace_labels: Mapping[str, str] = field(default_factory=dict)
    ports: Mapping[str, int] = field(default_factory=dict)

    @staticmethod
    def of(
        name: str,
        namespace: str,
        labels: Mapping[str, str],
        ports: Mapping[str, int] | None = None,
    ) -> Pod:
        """A pod in a namespace labelled the way Kubernetes labels every namespace."""
        namespace_labels = {"kubernetes.io/metadata.name": namespace}
        return Pod(name, namespace, labels, namespace_labels, ports or {})


def selects(selector: Mapping[str, Any] | None, labels: Mapping[str, str]) -> bool:
    """Whether a LabelSelector matches these labels (an empty selector matches everything)."""
    selector = selector or {}
    for key, value in selector.get("matchLabels", {}).items():
        if labels.get(key) != value:
            return False
    for expression in selector.get("matchExpressions", []):
        key, operator = expression["key"], expression["operator"]
        values = expression.get("values", [])
        if operator == "In":
            matched = key in labels and labels[key] in values
        elif operator == "NotIn":
            matched = labels.get(key) not in values
        elif operator == "Exists":
            matched = key in labels
        elif operator == "DoesNotExist":
            matched = key not in labels
        else:
            raise ValueError(f"unknown selector operator {operator}")
        if not matched:
            return False
    return True


def peer_matches(peer: Mapping[str, Any], source: Pod, policy_namespace: str) -> bool:
    if "ipBlock" in peer:
        return False
    if "namespaceSelector" in peer:
        in_namespace = selects(peer["namespaceSelector"], source.namespace_labels)
    else:
        in_namespace = source.namespace == policy_namespace
    return in_namespace and selects(peer.get("podSelector"), source.labels)


def port_matches(ports: Sequence[Mapping[str, Any]] | None, destination: Pod, port: int) -> bool:
    if not ports:
        return True
    for entry in ports:
        if entry.get("protocol", "TCP") != "TCP":
            continue
        first = entry.get("port")
        if first is None:
            return True
        if isinstance(first, str):
            first = destination.ports.get(first)
            if first is None:
                continue
        if first <= port <= entry.get("endPort", first):
            return True
    return False


def isolating(policies: Iterable[Manifest], destination: Pod, namespace: str) -> list[Manifest]:
    """The policies that select `destination` for ingress."""
    return [
        policy
        for policy in policies
        if policy["metadata"].get("namespace", namespace) == destination.namespace
        and "Ingress" in policy["spec"].get("policyTypes", ["Ingress"])
        and selects(policy["spec"].get("podSelector"), destination.labels)
    ]


def admitted(
    policies: Iterable[Manifest], source: Pod, destination: Pod, port: int, namespace: str
) -> bool:
    """Whether a TCP connection from `source` to `destination`:`port` is let in. `namespace` is
    the one of policies whose metadata names none (as `helm template` renders them)."""
    selecting = isolating(policies, destination, namespace)
    if not selecting:
        return True
    for policy in selecting:
        policy_namespace = policy["metadata"].get("namespace", namespace)
        for rule in policy["spec"].get("ingress", []):
            peers = rule.get("from")
            if peers and not any(peer_matches(p, source, policy_namespace) for p in peers):
                continue
            if port_matches(rule.get("ports"), destination, port):
                return True
    return False
