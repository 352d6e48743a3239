"""Who a request comes from, as far as the operator trusts it: the key of per-client limits
(the cap on a client's open event streams).

The socket's peer is the client unless it is one of the operator's proxies
(`KPO_TRUSTED_PROXIES`, the Ingress): then the client is the address that proxy appended to
`X-Forwarded-For`, read from the right past every trusted proxy. What a client writes in that
header itself is never believed, since any client can send one; uvicorn's own reading of the
header (which trusts loopback peers) is off on every listener (services.api.listeners).

The API token does not key these limits: there is one token, and every client holds it, so it
tells no client from another (keyed on it, all clients would share one client's cap).
"""

from __future__ import annotations

import ipaddress
from collections.abc import Sequence

from starlette.requests import Request

Network = ipaddress.IPv4Network | ipaddress.IPv6Network
UNKNOWN = "unknown"


def client_key(request: Request, proxies: Sequence[Network]) -> str:
    """The address that counts as the client of `request`, given the trusted `proxies`."""
    peer = request.client.host if request.client else UNKNOWN
    if not _trusted(peer, proxies):
        return peer
    forwarded = [
        address.strip()
        for header in request.headers.getlist("x-forwarded-for")
        for address in header.split(",")
    ]
    nearest = peer
    for address in reversed(forwarded):
        if _parsed(address) is None:
            break  # past a malformed entry nothing was written by a proxy we trust
        nearest = address
        if not _trusted(address, proxies):
            break
    return nearest


def _parsed(text: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        return ipaddress.ip_address(text)
    except ValueError:
        return None


def _trusted(address: str, proxies: Sequence[Network]) -> bool:
    ip = _parsed(address)
    return ip is not None and any(ip in network for network in proxies)
