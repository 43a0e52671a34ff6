"""CORS and the Origin check on a real server: which web pages may read the API, and which may change anything."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
from api_server import serve
from fastapi import APIRouter, Depends

from meshllm.api.app import ApiAccess, EdgePolicy, LocalBackend, create_app
from meshllm.api.auth import require_admin
from meshllm.api.edge import check_origin
from meshllm.engine.llama import LlamaEngine
from meshllm.errors import ConfigError

ADMIN = "admin-token-0123456789abcdefghij"
TOKEN = {"authorization": f"Bearer {ADMIN}"}
APP_ORIGIN = "https://app.example.com"


def poke_router() -> APIRouter:
    router = APIRouter()

    @router.post("/api/poke", dependencies=[Depends(require_admin)])
    async def poke() -> dict[str, bool]:
        return {"poked": True}

    return router


@pytest.fixture(scope="module")
def server(tiny_engine: LlamaEngine) -> Iterator[str]:
    policy = EdgePolicy.build("127.0.0.1", cors_origins=[APP_ORIGIN])
    app = create_app(LocalBackend([tiny_engine]), routers=[poke_router()], access=ApiAccess(ADMIN), policy=policy)
    with serve(app) as url:
        yield url


def preflight(url: str, origin: str, path: str = "/v1/chat/completions") -> httpx.Response:
    return httpx.options(url + path, headers={"origin": origin, "access-control-request-method": "POST",
                                              "access-control-request-headers": "authorization,content-type,"
                                                                                "x-stainless-os"})


@pytest.mark.parametrize("origin", ["http://localhost:5173", "http://127.0.0.1:3000", "http://[::1]:8080",
                                    APP_ORIGIN])
def test_pages_from_loopback_and_configured_origins_may_use_the_api(server: str, origin: str) -> None:
    answer = preflight(server, origin)
    assert answer.status_code == 200 and answer.headers["access-control-allow-origin"] == origin
    assert "authorization" in answer.headers["access-control-allow-headers"].lower()
    read = httpx.get(server + "/v1/models", headers={"origin": origin})
    assert read.headers["access-control-allow-origin"] == origin


@pytest.mark.parametrize("origin", ["https://evil.example", "http://localhost.evil.example", "null",
                                    "https://app.example.com.evil.example"])
def test_pages_from_other_origins_can_neither_read_nor_change(server: str, origin: str) -> None:
    assert preflight(server, origin).status_code == 400
    read = httpx.get(server + "/v1/models", headers={"origin": origin})
    assert "access-control-allow-origin" not in read.headers, "the browser hides the answer from the page"
    for path in ("/api/poke", "/v1/chat/completions"):
        refused = httpx.post(server + path, headers={"origin": origin, "content-type": "text/plain", **TOKEN},
                             content=b"{}")
        assert refused.status_code == 403 and refused.json()["error"]["code"] == "origin_not_allowed", path


def test_an_allowed_page_still_needs_the_token_to_manage(server: str) -> None:
    origin = {"origin": "http://localhost:5173"}
    assert httpx.post(server + "/api/poke", headers=origin).status_code == 401
    assert httpx.post(server + "/api/poke", headers={**origin, **TOKEN}).json() == {"poked": True}


def test_any_origin_when_asked(tiny_engine: LlamaEngine) -> None:
    policy = EdgePolicy.build("127.0.0.1", cors_origins=["*"])
    with serve(create_app(LocalBackend([tiny_engine]), policy=policy)) as url:
        answer = preflight(url, "https://anywhere.example")
        assert answer.status_code == 200 and answer.headers["access-control-allow-origin"] == "*"


@pytest.mark.parametrize("bad", ["example.com", "https://x.example/path", "ftp://x.example", "https://"])
def test_cors_origins_must_be_origins(bad: str) -> None:
    with pytest.raises(ConfigError):
        check_origin(bad)
    assert check_origin("https://x.example/") == "https://x.example"
