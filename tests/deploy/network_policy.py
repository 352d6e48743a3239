"""What a set of NetworkPolicies lets through, decided offline as Kubernetes defines it.

Ingress: a pod is isolated for ingress once a policy with `Ingress` in its policyTypes selects it;
then a connection to it is admitted when a rule of one of those policies matches both the source
(a `from` peer, or no `from` at all) and the destination port (a `ports` entry, or none at all).

Egress, the same from the other end: a pod is isolated for egress once a policy with `Egress` in
its policyTypes selects it; then a connection it opens is let out when a rule of one of those
policies matches both the destination (a `to` peer, or no `to` at all) and the port. A policy
without policyTypes has `Ingress`, and `Egress` too when it has egress rules.

A connection between two pods needs both: out of the source and into the destination.

A peer with only `podSelector` means pods of the policy's namespace; with only
`namespaceSelector`, every pod of those namespaces; with both, the pods matching both. An
`ipBlock` peer matches an `Address` (a destination outside the cluster's pods) inside its `cidr`
and outside every `except`, and never a pod: whether a plugin matches pod IPs against ipBlocks is
left undefined by Kubernetes, and the chart never relies on it. Ports named in a policy resolve
against the destination pod's container ports; TCP and UDP are modelled.
"""

from __future__ import annotations

import ipaddress
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


@dataclass(frozen=True)
class Address:
    """A destination that is not a pod of the cluster: an API server, a hub, a metadata
    endpoint. Only ipBlock peers match it."""

    ip: str

    @property
    def name(self) -> str:
        return self.ip


Destination = Pod | Address


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


def in_ip_block(block: Mapping[str, Any], ip: str) -> bool:
    """Whether `ip` lies in the ipBlock's cidr and outside each of its excepts."""
    address = ipaddress.ip_address(ip)
    if address not in ipaddress.ip_network(block["cidr"]):
        return False
    return not any(address in ipaddress.ip_network(cidr) for cidr in block.get("except", []))


def peer_matches(peer: Mapping[str, Any], other: Destination, policy_namespace: str) -> bool:
    """Whether a `from`/`to` peer matches a pod or an address."""
    if isinstance(other, Address):
        return "ipBlock" in peer and in_ip_block(peer["ipBlock"], other.ip)
    if "ipBlock" in peer:
        return False
    if "namespaceSelector" in peer:
        in_namespace = selects(peer["namespaceSelector"], other.namespace_labels)
    else:
        in_namespace = other.namespace == policy_namespace
    return in_namespace and selects(peer.get("podSelector"), other.labels)


def port_matches(
    ports: Sequence[Mapping[str, Any]] | None,
    destination: Destination,
    port: int,
    protocol: str = "TCP",
) -> bool:
    if not ports:
        return True
    for entry in ports:
        if entry.get("protocol", "TCP") != protocol:
            continue
        first = entry.get("port")
        if first is None:
            return True
        if isinstance(first, str):
            named = destination.ports if isinstance(destination, Pod) else {}
            first = named.get(first)
            if first is None:
                continue
        if first <= port <= entry.get("endPort", first):
            return True
    return False


def policy_types(policy: Manifest) -> list[str]:
    """The policy's types, with Kubernetes' default when it states none."""
    spec = policy["spec"]
    if "policyTypes" in spec:
        return list(spec["policyTypes"])
    return ["Ingress", "Egress"] if spec.get("egress") else ["Ingress"]


def isolating(
    policies: Iterable[Manifest], pod: Pod, namespace: str, direction: str = "Ingress"
) -> list[Manifest]:
    """The policies that select `pod` for `direction` (`Ingress` or `Egress`)."""
    return [
        policy
        for policy in policies
        if policy["metadata"].get("namespace", namespace) == pod.namespace
        and direction in policy_types(policy)
        and selects(policy["spec"].get("podSelector"), pod.labels)
    ]


def admitted(
    policies: Iterable[Manifest],
    source: Pod,
    destination: Pod,
    port: int,
    namespace: str,
    protocol: str = "TCP",
) -> bool:
    """Whether a connection from `source` to `destination`:`port` is let in. `namespace` is the
    one of policies whose metadata names none (as `helm template` renders them)."""
    selecting = isolating(policies, destination, namespace, "Ingress")
    if not selecting:
        return True
    for policy in selecting:
        policy_namespace = policy["metadata"].get("namespace", namespace)
        for rule in policy["spec"].get("ingress") or []:
            peers = rule.get("from")
            if peers and not any(peer_matches(p, source, policy_namespace) for p in peers):
                continue
            if port_matches(rule.get("ports"), destination, port, protocol):
                return True
    return False


def sent(
    policies: Iterable[Manifest],
    source: Pod,
    destination: Destination,
    port: int,
    namespace: str,
    protocol: str = "TCP",
) -> bool:
    """Whether a connection from `source` to `destination`:`port` is let out of `source`."""
    selecting = isolating(policies, source, namespace, "Egress")
    if not selecting:
        return True
    for policy in selecting:
        policy_namespace = policy["metadata"].get("namespace", namespace)
        for rule in policy["spec"].get("egress") or []:
            peers = rule.get("to")
            if peers and not any(peer_matches(p, destination, policy_namespace) for p in peers):
                continue
            if port_matches(rule.get("ports"), destination, port, protocol):
                return True
    return False


def connects(
    policies: Sequence[Manifest],
    source: Pod,
    destination: Destination,
    port: int,
    namespace: str,
    protocol: str = "TCP",
) -> bool:
    """Whether a connection goes through: out of the source, and into the destination when it
    is a pod."""
    if not sent(policies, source, destination, port, namespace, protocol):
        return False
    if isinstance(destination, Address):
        return True
    return admitted(policies, source, destination, port, namespace, protocol)
