"""Every error leaves the API as JSON: {"error": {"type", "message", "fields"?}}.

Store errors map to statuses here, at the edge, and nowhere else: an unknown run is a 404, an
illegal status change or a reused idempotency key a 409, a run past the cap on active runs a 429
(with `Retry-After` and the cap as `limit`), an unreachable store a 503. A request
body that is not a valid RunSpec is a 422 naming each field and, from pydantic, the valid values;
one that is not JSON at all is a 422 saying where it stops being JSON, and one that is not UTF-8
(or nested too deeply to read) a 400 saying so.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from fastapi import FastAPI, Request, status
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from services.store import (
    BufferFull,
    IdempotencyConflict,
    InvalidCursor,
    InvalidTransition,
    QuotaExceeded,
    RunNotFound,
    StoreError,
    StoreUnavailable,
)

log = logging.getLogger(__name__)

# FastAPI's 400 for a JSON body it could not decode; the cause it chains says why.
FASTAPI_BODY_ERROR = "There was an error parsing the body"
# When a client refused for the cap on active runs should ask again: runs last minutes to hours.
QUOTA_RETRY_AFTER_S = 60

STORE_STATUSES: dict[type[StoreError], tuple[int, str]] = {
    RunNotFound: (status.HTTP_404_NOT_FOUND, "not_found"),
    IdempotencyConflict: (status.HTTP_409_CONFLICT, "idempotency_conflict"),
    InvalidTransition: (status.HTTP_409_CONFLICT, "conflict"),
    InvalidCursor: (status.HTTP_422_UNPROCESSABLE_CONTENT, "invalid_cursor"),
    QuotaExceeded: (status.HTTP_429_TOO_MANY_REQUESTS, "quota_exceeded"),
    StoreUnavailable: (status.HTTP_503_SERVICE_UNAVAILABLE, "store_unavailable"),
    BufferFull: (status.HTTP_503_SERVICE_UNAVAILABLE, "store_unavailable"),
}


def error_response(
    code: int,
    kind: str,
    message: str,
    headers: Mapping[str, str] | None = None,
    **extra: Any,
) -> JSONResponse:
    return JSONResponse(
        {"error": {"type": kind, "message": message, **extra}},
        status_code=code,
        headers=dict(headers) if headers else None,
    )


def _field_errors(error: RequestValidationError) -> list[dict[str, str]]:
    """One entry per problem: the dotted field (without FastAPI's `body`) and the message."""
    fields = []
    for item in error.errors():
        if item.get("type") == "json_invalid":
            fields.append({"field": "(body)", "message": _json_problem(item)})
            continue
        loc = [str(part) for part in item.get("loc", ())]
        if loc and loc[0] == "body":
            loc = loc[1:]
        fields.append({"field": ".".join(loc) or "(body)", "message": str(item.get("msg", ""))})
    return fields


def _json_problem(item: Mapping[str, Any]) -> str:
    # FastAPI puts the character offset where a field name would be: say what it is.
    loc = item.get("loc", ())
    where = f" at character {loc[-1]}" if len(loc) > 1 else ""
    reason = (item.get("ctx") or {}).get("error", "")
    return f"the request body is not valid JSON{where}" + (f": {reason}" if reason else "")


def _unparsable_body(cause: BaseException | None) -> str:
    """What made a JSON body unreadable, from the exception FastAPI's 400 hides."""
    if isinstance(cause, UnicodeDecodeError):
        return (
            f"the request body is not valid UTF-8 ({cause.reason} at byte {cause.start}); "
            "send JSON encoded as UTF-8"
        )
    if isinstance(cause, RecursionError):
        return "the request body is JSON nested too deeply to read"
    return "the request body could not be read as JSON"


async def _validation(request: Request, error: RequestValidationError) -> JSONResponse:
    fields = _field_errors(error)
    message = "; ".join(f"{f['field']}: {f['message']}" for f in fields)
    return error_response(422, "validation_error", message, fields=fields)


async def _store_error(request: Request, error: Exception) -> JSONResponse:
    code, kind = next(
        (mapped for cls, mapped in STORE_STATUSES.items() if isinstance(error, cls)),
        (500, "store_error"),
    )
    if code >= 500:
        log.warning("store error on %s %s: %s", request.method, request.url.path, error)
    if isinstance(error, QuotaExceeded):
        return error_response(
            code,
            kind,
            f"{error} (KPO_MAX_ACTIVE_RUNS on the server)",
            headers={"Retry-After": str(QUOTA_RETRY_AFTER_S)},
            limit=error.limit,
        )
    return error_response(code, kind, str(error))


async def _http(request: Request, error: Exception) -> JSONResponse:
    assert isinstance(error, StarletteHTTPException)
    kind = {
        400: "bad_request",
        401: "unauthorized",
        404: "not_found",
        405: "method_not_allowed",
        409: "conflict",
        413: "payload_too_large",
        429: "too_many_requests",
        503: "unavailable",
    }.get(error.status_code, "http_error")
    message = str(error.detail)
    if error.status_code == 400 and message == FASTAPI_BODY_ERROR:
        message = _unparsable_body(error.__cause__)
    return error_response(error.status_code, kind, message, headers=error.headers)


async def _unexpected(request: Request, error: Exception) -> JSONResponse:
    # A bug, never the user's input: logged with its traceback, reported without it.
    log.exception("unhandled error on %s %s", request.method, request.url.path)
    return error_response(500, "internal_error", "internal error; see the server log")


def install_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(RequestValidationError, _validation)  # type: ignore[arg-type]
    app.add_exception_handler(StoreError, _store_error)
    app.add_exception_handler(StarletteHTTPException, _http)
    app.add_exception_handler(Exception, _unexpected)
