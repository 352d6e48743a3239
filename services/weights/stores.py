"""Where the TCPStores of weight groups and of the learner's rendezvous listen.

torch's TCPStore server listens on every interface (`::`), whatever host it is given. Here a
store is served on a socket bound to exactly the address its members are told (`serve_store`):
the node's address that Ray uses, or loopback for a group that cannot span nodes
(`serving_host`: every process of the run is on one Ray node). The store still authenticates
nobody: a weight group's messages carry tags of their own (`services.weights.auth`), and what
torch itself keeps in a store (gloo's addresses, NCCL's unique id) relies on the network
reaching the node being the cluster's (deploy: the Ray pods' NetworkPolicy).
"""

from __future__ import annotations

import contextlib
import ipaddress
import socket
from datetime import timedelta

from torch._C._distributed_c10d import TCPStore

LOOPBACK = "127.0.0.1"


def node_address() -> str:
    """This node's IP as other nodes reach it (Ray's view of the node)."""
    import ray

    host: str = ray.util.get_node_ip_address()  # type: ignore[no-untyped-call]
    return host


def is_loopback(host: str) -> bool:
    """Whether `host` is a loopback address (a literal IP; names are not resolved)."""
    with contextlib.suppress(ValueError):
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    return host == "localhost"


def member_host(group_address: str) -> str:
    """Where a weight group member's own connections listen, for a group served at
    `group_address` (host:port): loopback for a group served on loopback (it cannot span
    nodes), else this node's address."""
    host = group_address.rpartition(":")[0]
    return host.strip("[]") if is_loopback(host) else node_address()


def single_node() -> bool:
    """Whether this process belongs to a Ray cluster of one live node (every actor of the run,
    present and to come, then shares this host); False outside Ray."""
    import ray

    if not ray.is_initialized():
        return False
    alive = [node for node in ray.nodes() if node.get("Alive")]  # type: ignore[no-untyped-call]
    return len(alive) == 1


def serving_host() -> str:
    """The address a group's store (and its rank 0's connections) should listen on: loopback
    where the Ray cluster is one node, else this node's address."""
    return LOOPBACK if single_node() else node_address()


def _listening_socket(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host.strip("[]") else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host.strip("[]"), port))
        sock.listen(socket.SOMAXCONN)
    except OSError:
        sock.close()
        raise
    return sock


def serve_store(
    host: str, port: int, world_size: int, timeout: timedelta, *, wait_for_workers: bool
) -> TCPStore:
    """A TCPStore server listening on `host`:`port` only (port 0: a free one; read it from
    the store's `port`). `wait_for_workers`: return only once `world_size` - 1 clients came."""
    sock = _listening_socket(host, port)
    bound = sock.getsockname()[1]
    # The store owns the socket from here (it closes the descriptor when it is destroyed).
    fd = sock.detach()
    return TCPStore(
        host.strip("[]"),
        bound,
        world_size,
        is_master=True,
        timeout=timeout,
        wait_for_workers=wait_for_workers,
        master_listen_fd=fd,
    )
