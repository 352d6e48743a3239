"""The dashboard: `GET /` serves the page, `GET /static/{name}` its script and style sheet.

The page (services/api/static) is plain HTML, JavaScript and CSS with no build step and nothing
loaded from elsewhere; it reads the REST API and the SSE stream like any other client. Files are
looked up by exact name in a table built from the static folder, so no request path ever reaches
the file system (no traversal, no directory listing).
"""

from __future__ import annotations

import re
from pathlib import Path

from fastapi import APIRouter, HTTPException
from fastapi.responses import FileResponse, Response

STATIC_DIR = Path(__file__).resolve().parent / "static"
CONTENT_TYPES = {
    ".html": "text/html; charset=utf-8",
    ".js": "text/javascript; charset=utf-8",
    ".css": "text/css; charset=utf-8",
    ".svg": "image/svg+xml",
    ".png": "image/png",
    ".ico": "image/x-icon",
}
_SERVED_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")
# The page runs only its own script and style and talks only to this origin: even if some text
# escaped escaping, no injected script or remote resource would run.
CONTENT_SECURITY_POLICY = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
    "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)
# The page is small and changes with upgrades; revalidating each load keeps it current.
COMMON_HEADERS = {"Cache-Control": "no-cache", "X-Content-Type-Options": "nosniff"}

router = APIRouter(include_in_schema=False)


def static_files(directory: Path = STATIC_DIR) -> dict[str, Path]:
    """The files the router serves: plain files of a known type directly in `directory`."""
    return {
        path.name: path
        for path in sorted(directory.iterdir())
        if path.is_file() and path.suffix in CONTENT_TYPES and _SERVED_NAME.fullmatch(path.name)
    }


FILES = static_files()


@router.get("/")
def index() -> Response:
    """The dashboard page."""
    return _serve("index.html", {"Content-Security-Policy": CONTENT_SECURITY_POLICY})


@router.get("/static/{name}")
def static(name: str) -> Response:
    """One of the page's files, by exact name; 404 for any other name."""
    return _serve(name)


def _serve(name: str, extra_headers: dict[str, str] | None = None) -> Response:
    path = FILES.get(name)
    if path is None:
        raise HTTPException(404, f"no static file {name!r}")
    return FileResponse(
        path,
        media_type=CONTENT_TYPES[path.suffix],
        headers={**COMMON_HEADERS, **(extra_headers or {})},
    )
