"""Hostile and careless input over real HTTP: oversized, non-UTF-8 and non-JSON bodies, huge
page sizes, and run ids that try to leave their place. Each is a 4xx that says what to fix."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from services.api.settings import MAX_BODY_BYTES, ApiSettings
from services.spec import RunSpec
from tests.services.api.conftest import Api, ApiFactory
from tests.services.api.raw_http import RawResponse, raw_request
from tests.services.api.test_runs_api import TINY

LIMIT = 4096
EXAMPLES = Path(__file__).resolve().parents[3] / "examples"
JSON = {"content-type": "application/json"}


def padded(size: int) -> bytes:
    """A valid run spec as JSON, padded with spaces to exactly `size` bytes."""
    body = json.dumps(TINY).encode()
    return body + b" " * (size - len(body))


def post_chunked(api: Api, path: str, body: bytes, content_type: str | None) -> RawResponse:
    """POST `body` in 1000-byte chunks, with no Content-Length (raw: the framing is the test)."""
    head = f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nTransfer-Encoding: chunked"
    if content_type is not None:
        head += f"\r\nContent-Type: {content_type}"
    chunks = [body[i : i + 1000] for i in range(0, len(body), 1000)]
    framed = b"".join(b"%x\r\n%s\r\n" % (len(c), c) for c in chunks) + b"0\r\n\r\n"
    return raw_request(api.url, head.encode(), framed)


def error_of(response: httpx.Response | RawResponse) -> dict[str, Any]:
    error: dict[str, Any] = response.json()["error"]
    return error


@pytest.fixture
def small(api_factory: ApiFactory) -> Iterator[Api]:
    """An API that takes bodies of at most LIMIT bytes."""
    with api_factory(KPO_MAX_BODY_BYTES=str(LIMIT)) as running:
        yield running


# --- body size ----------------------------------------------------------------------------


def test_a_body_at_the_limit_passes_and_one_byte_more_is_413(small: Api) -> None:
    at_limit = small.client.post("/v1/runs", content=padded(LIMIT), headers=JSON)
    assert at_limit.status_code == 201, at_limit.text
    over = small.client.post("/v1/runs", content=padded(LIMIT + 1), headers=JSON)
    assert over.status_code == 413
    assert error_of(over) == {
        "type": "payload_too_large",
        "message": f"the request body is larger than the limit of {LIMIT} bytes "
        "(KPO_MAX_BODY_BYTES on the server)",
    }
    assert len(small.launcher.submitted) == 1


def test_the_default_limit_is_256_kib_far_above_any_real_spec(api: Api) -> None:
    assert ApiSettings.model_validate({}).max_body_bytes == MAX_BODY_BYTES == 256 * 1024
    at_limit = api.client.post("/v1/runs", content=padded(MAX_BODY_BYTES), headers=JSON)
    assert at_limit.status_code == 201, at_limit.text
    over = api.client.post("/v1/runs", content=padded(MAX_BODY_BYTES + 1), headers=JSON)
    assert over.status_code == 413
    assert f"limit of {MAX_BODY_BYTES} bytes" in error_of(over)["message"]
    # Every shipped run file, resolved (every default filled in) as the API stores it, is a
    # few kilobytes: a 64th of the limit leaves room for far longer ones.
    run_files = [p for p in sorted(EXAMPLES.glob("*.yaml")) if not p.name.startswith("algorithm-")]
    assert len(run_files) >= 5
    for path in run_files:
        data = yaml.safe_load(path.read_text())
        resolved = json.dumps(RunSpec.model_validate(data).model_dump(mode="json"))
        assert len(resolved.encode()) < MAX_BODY_BYTES / 64, path


def test_a_chunked_body_without_a_length_is_counted_as_it_arrives(small: Api) -> None:
    at_limit = post_chunked(small, "/v1/runs", padded(LIMIT), "application/json")
    assert at_limit.status == 201, at_limit.body
    over = post_chunked(small, "/v1/runs", padded(LIMIT + 1), "application/json")
    assert over.status == 413
    assert f"limit of {LIMIT} bytes" in error_of(over)["message"]
    far_over = post_chunked(small, "/v1/runs", padded(50 * LIMIT), "application/json")
    assert far_over.status == 413
    assert len(small.launcher.submitted) == 1


def test_a_declared_huge_length_is_refused_before_the_body_is_read(small: Api) -> None:
    # Claims a terabyte and sends two bytes: an answer at all proves nothing waited for the rest.
    head = b"POST /v1/runs HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json"
    response = raw_request(small.url, head + b"\r\nContent-Length: 1000000000000", b"{}")
    assert response.status == 413
    assert error_of(response)["type"] == "payload_too_large"


def test_routes_that_take_no_body_still_refuse_a_large_one(small: Api) -> None:
    run = small.client.post("/v1/runs", json=TINY).json()["id"]
    cancel = small.client.post(f"/v1/runs/{run}/cancel", content=b" " * (LIMIT + 1), headers=JSON)
    assert cancel.status_code == 413
    assert small.client.get(f"/v1/runs/{run}").json()["status"] == "queued"


# --- encoding -----------------------------------------------------------------------------

NOT_UTF8 = [
    b'{"name": "\xff"}',  # a byte that never occurs in UTF-8
    b'{"name": "caf\xe9"}',  # Latin-1
    b'{"name": "\xc0\xaf"}',  # an overlong encoding of '/'
    b'{"name": "\xe2\x82"}',  # a truncated sequence
    b'{"model": "\xf8\x88\x80\x80\x80"}',  # a five-byte form
    b'{"task": {"name": "jsonl", "path": "a\xff/../../etc/passwd"}}',
]


@pytest.mark.parametrize("body", NOT_UTF8)
def test_a_body_that_is_not_utf8_is_a_400_saying_so(api: Api, body: bytes) -> None:
    response = api.client.post("/v1/runs", content=body, headers=JSON)
    assert response.status_code == 400
    error = error_of(response)
    assert error["type"] == "bad_request"
    assert error["message"].startswith("the request body is not valid UTF-8 (")
    assert error["message"].endswith("; send JSON encoded as UTF-8")
    assert api.launcher.submitted == []


def test_text_that_decodes_but_is_not_json_or_not_a_string_is_a_422(api: Api) -> None:
    def post(body: bytes) -> httpx.Response:
        return api.client.post("/v1/runs", content=body, headers=JSON)

    bom_garbage = post(b"\xff\xfe\x00garbage")  # read as UTF-16 by its byte-order mark
    assert bom_garbage.status_code == 422
    assert error_of(bom_garbage)["fields"] == [
        {
            "field": "(body)",
            "message": "the request body is not valid JSON at character 0: Expecting value",
        }
    ]
    surrogate = post(b'{"learner": {"device": "\xed\xa0\x80"}}')  # UTF-8 of a lone surrogate
    assert surrogate.status_code == 422
    assert error_of(surrogate)["fields"][0]["field"] == "learner.device"
    deep = post(b"[" * 100_000)
    assert deep.status_code == 400
    assert error_of(deep)["message"] == "the request body is JSON nested too deeply to read"
    assert api.launcher.submitted == []


# --- content types ------------------------------------------------------------------------

WRONG_TYPES = [
    "text/plain",
    "application/x-www-form-urlencoded",
    "multipart/form-data; boundary=x",
    "application/xml",
    "text/json",
    "application/merge-patch+json",
    "application/json; charset=latin-1",
    "application/json; charset=utf-16",
]


@pytest.mark.parametrize("content_type", WRONG_TYPES)
def test_a_body_of_another_type_is_a_415_naming_json(api: Api, content_type: str) -> None:
    body = json.dumps(TINY).encode()
    response = api.client.post("/v1/runs", content=body, headers={"content-type": content_type})
    assert response.status_code == 415
    error = error_of(response)
    assert error["type"] == "unsupported_media_type"
    assert "application/json" in error["message"]
    chunked = post_chunked(api, "/v1/runs", body, content_type)
    assert chunked.status == 415 and error_of(chunked) == error
    assert api.launcher.submitted == []


def test_a_body_without_a_content_type_is_a_415(api: Api) -> None:
    body = json.dumps(TINY).encode()
    expected = {
        "type": "unsupported_media_type",
        "message": "the request body has no Content-Type: send it as application/json",
    }
    plain = api.client.post("/v1/runs", content=body)
    assert "content-type" not in plain.request.headers
    assert plain.status_code == 415 and error_of(plain) == expected
    assert error_of(post_chunked(api, "/v1/runs", body, None)) == expected
    form = api.client.post("/v1/runs", data={"name": "x"})
    files = api.client.post("/v1/runs", files={"spec": ("spec.json", body, "application/json")})
    assert form.status_code == files.status_code == 415
    run = api.client.post("/v1/runs", json=TINY).json()["id"]
    assert api.client.post(f"/v1/runs/{run}/cancel", content=b"x").status_code == 415
    assert api.launcher.submitted == [run] and api.launcher.stopped == []


def test_json_with_its_usual_spellings_is_accepted(api: Api) -> None:
    body = json.dumps(TINY).encode()
    for content_type in (
        "application/json",
        "Application/JSON",
        'application/json; charset="UTF-8"',
    ):
        response = api.client.post("/v1/runs", content=body, headers={"content-type": content_type})
        assert response.status_code == 201, (content_type, response.text)
    # No body, no type needed: a cancel is a bare POST.
    run = api.client.post("/v1/runs", json=TINY).json()["id"]
    assert api.client.post(f"/v1/runs/{run}/cancel").status_code == 202


# --- page sizes and steps -----------------------------------------------------------------

HUGE = str(10**30)
OUT_OF_RANGE = [
    ("/v1/runs", "limit", HUGE),
    ("/v1/runs", "limit", "101"),
    ("/v1/runs", "limit", "0"),
    ("/v1/runs", "limit", "1e9"),
    ("/v1/runs", "cursor", "c" * 201),
    ("/v1/runs/{run}/metrics", "limit", HUGE),
    ("/v1/runs/{run}/metrics", "limit", "10001"),
    ("/v1/runs/{run}/metrics", "since_step", HUGE),
    ("/v1/runs/{run}/metrics", "since_step", str(2**53)),
    ("/v1/runs/{run}/metrics", "since_step", "-2"),
    ("/v1/runs/{run}/metrics", "since_step", "NaN"),
    ("/v1/runs/{run}/logs", "tail", HUGE),
    ("/v1/runs/{run}/logs", "tail", "10001"),
    ("/v1/runs/{run}/events", "last_event_id", "1" * 101),
]


def test_out_of_range_sizes_and_steps_are_a_422_naming_the_field(api: Api) -> None:
    run = api.client.post("/v1/runs", json=TINY).json()["id"]
    for path, field, value in OUT_OF_RANGE:
        response = api.client.get(path.format(run=run), params={field: value})
        assert response.status_code == 422, (path, field, value, response.text)
        assert [f["field"] for f in error_of(response)["fields"]] == [f"query.{field}"]
    # The largest values allowed are served, not allocated: the store reads what exists.
    biggest = {"since_step": 2**53 - 1, "limit": 10_000}
    page = api.client.get(f"/v1/runs/{run}/metrics", params=biggest)
    assert page.status_code == 200 and page.json()["records"] == []
    assert api.client.get(f"/v1/runs/{run}/logs", params={"tail": 10_000}).json()["lines"] == []


def test_an_overlong_request_line_or_header_is_refused_by_the_http_server(api: Api) -> None:
    long_query = raw_request(api.url, b"GET /v1/runs?cursor=" + b"c" * 200_000 + b" HTTP/1.1")
    assert long_query.status == 400
    long_header = raw_request(api.url, b"GET /v1/runs HTTP/1.1\r\nX-Pad: " + b"p" * 200_000)
    assert long_header.status == 400


# --- run ids ------------------------------------------------------------------------------

HOSTILE_IDS = [
    b"..%2F..%2Fetc%2Fpasswd",
    b"%2e%2e%2f%2e%2e%2fetc%2fpasswd",
    b"..",
    b"%2e%2e",
    b"run-%00",
    b"run-000000000000%00",
    b"%00",
    b"run-000000000000%2F..",
    b"a%5C..%5C..%5Cetc%5Cpasswd",
    b"%ff%fe",
    b"%252e%252e%252fetc",
    b"RUN-000000000000",
    b"run-0000000000000",
    b"x" * 5000,
]


@pytest.mark.parametrize("run_id", HOSTILE_IDS, ids=lambda raw: raw[:30].decode())
def test_a_run_id_can_only_name_a_run(api: Api, run_id: bytes) -> None:
    for method, suffix in (
        (b"GET", b""),
        (b"GET", b"/metrics"),
        (b"GET", b"/logs"),
        (b"GET", b"/events"),
        (b"POST", b"/cancel"),
    ):
        request = method + b" /v1/runs/" + run_id + suffix + b" HTTP/1.1\r\nHost: 127.0.0.1"
        response = raw_request(api.url, request)
        if b"%2f" in run_id.lower():
            # The server decodes %2F: the path has more segments and matches no route.
            assert response.status == 404, (request, response)
        else:
            # Any other id is checked for the store's format before the store sees it.
            assert response.status == 422, (request, response)
            assert [f["field"] for f in error_of(response)["fields"]] == ["path.run_id"]
        assert b"root:" not in response.body and len(response.body) < 1000
