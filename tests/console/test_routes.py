"""The routes that serve the console: the page at ``/``, its files under ``/console/``, nothing else.

Real HTTP (uvicorn on 127.0.0.1) with the node's error handlers, so unknown paths answer the same
OpenAI-shaped 404 as every other route.
"""

from __future__ import annotations

import re
from collections.abc import Iterator

import httpx
import pytest
from api.api_server import serve
from fastapi import FastAPI

from meshllm.api.console import CONTENT_TYPES, console_router
from meshllm.api.errors import install_error_handlers
from meshllm.console import static_files
from meshllm.events import events_module_js


@pytest.fixture(scope="module")
def base() -> Iterator[str]:
    app = FastAPI()
    install_error_handlers(app)
    app.include_router(console_router())
    with serve(app) as url:
        yield url


def test_the_page_is_served_at_the_root_with_a_strict_policy(base: str) -> None:
    response = httpx.get(base + "/")
    assert response.status_code == 200 and response.headers["content-type"] == "text/html; charset=utf-8"
    assert 'content="meshllm console"' in response.text
    policy = response.headers["content-security-policy"]
    assert "script-src 'self'" in policy and "connect-src 'self'" in policy and "frame-ancestors 'none'" in policy
    assert response.headers["x-content-type-options"] == "nosniff"
    assert response.headers["referrer-policy"] == "no-referrer"


def test_every_file_the_page_refers_to_is_served_with_its_type(base: str) -> None:
    files = static_files()
    wanted = set(re.findall(r'(?:href|src)="/console/([\w.-]+)"', files["index.html"].decode()))
    for name, data in files.items():
        if name.endswith(".js"):
            wanted |= set(re.findall(r'from "\./([\w.-]+)"', data.decode()))
    assert {"main.js", "console.css", "api.js", "map.js", "matrix.js", "chat.js", "owner.js", "live.js"} <= wanted
    for name in sorted(wanted):
        response = httpx.get(f"{base}/console/{name}")
        assert response.status_code == 200, name
        assert response.headers["content-type"] == CONTENT_TYPES[name[name.rfind("."):]]
        assert response.content == (events_module_js().encode() if name == "events.js" else files[name])


@pytest.mark.parametrize("path", ["/console/nope.js", "/console/../__init__.py", "/console/%2e%2e/__init__.py",
                                  "/console/", "/console/index.html", "/index.html"])
def test_nothing_else_is_served(base: str, path: str) -> None:
    response = httpx.get(base + path)
    assert response.status_code == 404
    assert response.json()["error"]["code"] == "not_found"


def test_the_page_cannot_be_posted_to(base: str) -> None:
    response = httpx.post(base + "/", json={})
    assert response.status_code == 405 and response.json()["error"]["code"] == "method_not_allowed"
