"""Bearer-token auth: every mutating call needs the token, reads too when configured."""

from __future__ import annotations

import hmac

from fastapi import HTTPException, Request, status

CHALLENGE = {"WWW-Authenticate": 'Bearer realm="kpo"'}


class BearerAuth:
    """Checks `Authorization: Bearer <token>`; with no token configured, everything passes."""

    def __init__(self, token: str | None, guard_reads: bool) -> None:
        self._token = token.encode() if token else None
        self.guard_reads = guard_reads

    @property
    def enabled(self) -> bool:
        return self._token is not None

    def check(self, request: Request, write: bool) -> None:
        """Raise 401 unless the request carries the token (or this call needs none)."""
        if self._token is None or not (write or self.guard_reads):
            return
        scheme, _, given = request.headers.get("authorization", "").partition(" ")
        # compare_digest: the time taken must not reveal how much of the token matched.
        if scheme.lower() != "bearer" or not hmac.compare_digest(
            given.strip().encode(), self._token
        ):
            raise HTTPException(
                status.HTTP_401_UNAUTHORIZED,
                "missing or wrong API token: send `Authorization: Bearer <KPO_API_TOKEN>`",
                headers=CHALLENGE,
            )
