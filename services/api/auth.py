"""Bearer-token auth: every mutating call needs the token, reads too when configured."""

from __future__ import annotations

import hmac
from collections.abc import Mapping

from fastapi import HTTPException, Request, status

CHALLENGE = {"WWW-Authenticate": 'Bearer realm="kpo"'}
UNAUTHORIZED = "missing or wrong API token: send `Authorization: Bearer <KPO_API_TOKEN>`"


class BearerAuth:
    """Checks `Authorization: Bearer <token>`; with no token configured, everything passes."""

    def __init__(self, token: str | None, guard_reads: bool, refusal: str = UNAUTHORIZED) -> None:
        """`refusal`: the 401's message, naming the token to send."""
        self._token = token.encode() if token else None
        self.guard_reads = guard_reads
        self.refusal = refusal

    @property
    def enabled(self) -> bool:
        return self._token is not None

    def allows(self, headers: Mapping[str, str], write: bool) -> bool:
        """Whether a request with `headers` may make this call (a write, or a read)."""
        if self._token is None or not (write or self.guard_reads):
            return True
        scheme, _, given = headers.get("authorization", "").partition(" ")
        # compare_digest: the time taken must not reveal how much of the token matched.
        return scheme.lower() == "bearer" and hmac.compare_digest(
            given.strip().encode(), self._token
        )

    def check(self, request: Request, write: bool) -> None:
        """Raise 401 unless the request carries the token (or this call needs none)."""
        if not self.allows(request.headers, write):
            raise HTTPException(status.HTTP_401_UNAUTHORIZED, self.refusal, headers=CHALLENGE)
