"""`RequestBodyGuard`: what a request body must be before any route sees it.

Every body the API takes is JSON, and none is large, and only a token holder may send one.
So, as plain ASGI in front of the routes:

- a body sent to a write (`POST`, `PUT`, `PATCH` under `/v1/`) without the API token is a 401
  before anything of it is read or parsed: a client without the token learns nothing of what
  the API would accept (a 413, 415, 400 or 422 says it); the routes check the token again;
- a body over `max_bytes` is a 413 naming the limit: at once when `Content-Length` says so, and
  as it arrives when no length was sent (a chunked body), so that no body is ever held whole
  before it is counted;
- a body sent to a write (`POST`, `PUT`, `PATCH` under `/v1/`) without `Content-Type:
  application/json` (text, form data, no type at all) or in a charset other than UTF-8 is a 415
  naming the type to send.

Invalid UTF-8 and malformed JSON inside an accepted body are reported by the error handlers
(services.api.errors), where the parser's own account of the problem is at hand.
"""

from __future__ import annotations

from collections.abc import Mapping

from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from services.api.auth import CHALLENGE, BearerAuth
from services.api.errors import error_response

JSON_MEDIA_TYPE = "application/json"
WRITE_METHODS = frozenset({"POST", "PUT", "PATCH"})
# RFC 8259: JSON exchanged between systems is UTF-8, and a charset parameter adds nothing.
UTF8_NAMES = frozenset({"utf-8", "utf8"})


def too_large_message(max_bytes: int) -> str:
    return (
        f"the request body is larger than the limit of {max_bytes} bytes "
        "(KPO_MAX_BODY_BYTES on the server)"
    )


class RequestBodyGuard:
    """Refuses oversized and non-JSON request bodies before the routes read them (see module)."""

    def __init__(
        self,
        app: ASGIApp,
        max_bytes: int,
        auth: BearerAuth,
        path_auth: Mapping[str, BearerAuth] | None = None,
    ) -> None:
        """`path_auth`: the auth of the paths guarded by a token of their own (Alertmanager's
        webhook), instead of the API's."""
        self.app = app
        self.max_bytes = max_bytes
        self.auth = auth
        self.path_auth = dict(path_auth or {})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        if not _has_body(headers):
            await self.app(scope, receive, send)
            return
        problem = self._refusal(scope, headers)
        if problem is not None:
            await problem(scope, receive, send)
            return
        await self.app(scope, self._counting(receive), send)

    def _refusal(self, scope: Scope, headers: Headers) -> ASGIApp | None:
        """The error response for a body its headers already rule out; None if none does."""
        write = scope["method"] in WRITE_METHODS and scope["path"].startswith("/v1/")
        auth = self.path_auth.get(scope["path"], self.auth)
        if write and not auth.allows(headers, write=True):
            return error_response(401, "unauthorized", auth.refusal, headers=CHALLENGE)
        declared = _declared_length(headers)
        if declared is not None and declared > self.max_bytes:
            # Answered unread: the client learns at once, and the server reads nothing.
            return error_response(413, "payload_too_large", too_large_message(self.max_bytes))
        if write:
            media_problem = _media_type_problem(headers.get("content-type"))
            if media_problem is not None:
                return error_response(415, "unsupported_media_type", media_problem)
        return None

    def _counting(self, receive: Receive) -> Receive:
        """`receive`, raising a 413 once more than `max_bytes` of body have arrived."""
        received = 0

        async def counted() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    # Raised inside the route's body read: the error handlers answer it.
                    raise HTTPException(413, too_large_message(self.max_bytes))
            return message

        return counted


def _has_body(headers: Headers) -> bool:
    """Whether the request carries a body (HTTP/1.1: a non-zero length, or a chunked one)."""
    return (_declared_length(headers) or 0) > 0 or "transfer-encoding" in headers


def _declared_length(headers: Headers) -> int | None:
    try:
        return int(headers.get("content-length", ""))
    except ValueError:  # absent (chunked); a malformed one never gets past the HTTP server
        return None


def _media_type_problem(content_type: str | None) -> str | None:
    """Why a body of `content_type` is not JSON this API reads; None when it is."""
    if not content_type:
        return f"the request body has no Content-Type: send it as {JSON_MEDIA_TYPE}"
    media, *params = (part.strip() for part in content_type.split(";"))
    if media.lower() != JSON_MEDIA_TYPE:
        return f"send the request body as {JSON_MEDIA_TYPE}, not {media or 'an empty type'}"
    for param in params:
        name, _, value = param.partition("=")
        charset = value.strip().strip('"').lower()
        if name.strip().lower() == "charset" and charset not in UTF8_NAMES:
            return f"send {JSON_MEDIA_TYPE} encoded as UTF-8, not charset={charset}"
    return None
