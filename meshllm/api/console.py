"""The web console's routes: ``GET /`` is the page, ``GET /console/<file>`` its scripts and styles.

The files ship in the package (``meshllm/console/static``) and are read once, when the router is
built: only those names are served (no path from a request ever reaches the filesystem), and a
missing file is a start-up error rather than a broken page. The page talks to the node only through
the public API (``/api/*``, ``/v1/*``) with the caller's token, so these routes need no authority:
they hand out the same bytes to everyone.

One script is not a file: ``/console/events.js`` is generated from the node's event types
(:func:`meshllm.events.events_module_js`), so the page reloads on the events the types say change
what it shows, without a second list of names to keep in step.
"""

from __future__ import annotations

from collections.abc import Callable

from fastapi import APIRouter
from fastapi.responses import Response

from meshllm.console import static_files
from meshllm.events import events_module_js

CONTENT_TYPES = {
    ".html": "text/html; charset=utf-8",
    ".js": "text/javascript; charset=utf-8",
    ".css": "text/css; charset=utf-8",
    ".svg": "image/svg+xml",
}

SECURITY_HEADERS = {
    # Only our own files run; the page may call only this origin; nothing may frame it (clickjacking).
    "Content-Security-Policy": ("default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
                                "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"),
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",
}


def console_router() -> APIRouter:
    """Routes serving the console's files, loaded into memory now."""
    files = {name: (data, CONTENT_TYPES[_suffix(name)]) for name, data in static_files().items()
             if _suffix(name) in CONTENT_TYPES}
    files["events.js"] = (events_module_js().encode(), CONTENT_TYPES[".js"])
    page, _ = files.pop("index.html")
    router = APIRouter(include_in_schema=False)

    @router.get("/")
    def index() -> Response:
        return Response(page, media_type=CONTENT_TYPES[".html"], headers=SECURITY_HEADERS)

    for name, (data, media_type) in files.items():
        router.add_api_route(f"/console/{name}", _file_route(data, media_type), methods=["GET"])
    return router


def _file_route(data: bytes, media_type: str) -> Callable[[], Response]:
    def serve() -> Response:
        return Response(data, media_type=media_type, headers=SECURITY_HEADERS)
    return serve


def _suffix(name: str) -> str:
    return name[name.rfind("."):] if "." in name else ""
