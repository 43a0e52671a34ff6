"""API keys and the admin token on a real server: the official OpenAI client, x-api-key, real nodes, the CLI."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from api_server import serve
from fastapi import APIRouter, Depends
from nodes import NodeProcess, meshllm, running_nodes

from meshllm.api.app import ApiAccess, LocalBackend, create_app
from meshllm.api.auth import check_api_key, require_admin, require_api_key
from meshllm.engine.llama import LlamaEngine
from meshllm.errors import ConfigError

KEY = "sk-test-key-0123456789abcdef"
ADMIN = "admin-token-0123456789abcdefghij"
HELLO = [{"role": "user", "content": "Hi"}]


def management_router() -> APIRouter:
    router = APIRouter()

    @router.post("/api/poke", dependencies=[Depends(require_admin)])
    async def poke() -> dict[str, bool]:
        return {"poked": True}

    @router.get("/api/look", dependencies=[Depends(require_api_key)])
    async def look() -> dict[str, bool]:
        return {"looked": True}

    return router


@pytest.fixture(scope="module")
def keyed(tiny_engine: LlamaEngine) -> Iterator[str]:
    """The tiny model behind an app with an API key and an admin token."""
    app = create_app(LocalBackend([tiny_engine]), routers=[management_router()], access=ApiAccess(ADMIN, (KEY,)))
    with serve(app) as url:
        yield url


@pytest.fixture(scope="module")
def open_api(tiny_engine: LlamaEngine) -> Iterator[str]:
    """The same without API keys: a loopback-only node."""
    app = create_app(LocalBackend([tiny_engine]), routers=[management_router()], access=ApiAccess(ADMIN))
    with serve(app) as url:
        yield url


def test_the_openai_client_works_with_the_key_and_not_without(keyed: str) -> None:
    client = openai.OpenAI(base_url=keyed + "/v1", api_key=KEY, max_retries=0)
    assert [m.id for m in client.models.list()] == ["tiny-llama", "auto"]
    reply = client.chat.completions.create(model="tiny-llama", messages=HELLO, max_tokens=4, temperature=0)  # type: ignore[arg-type]
    assert reply.usage is not None and reply.usage.completion_tokens >= 1
    wrong = openai.OpenAI(base_url=keyed + "/v1", api_key="sk-wrong-key-0123456789", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as caught:
        wrong.chat.completions.create(model="tiny-llama", messages=HELLO, max_tokens=4)  # type: ignore[arg-type]
    assert caught.value.status_code == 401 and caught.value.code == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        wrong.models.list()


def test_x_api_key_and_the_admin_token_are_accepted_too(keyed: str) -> None:
    for headers in ({"x-api-key": KEY}, {"authorization": f"Bearer {ADMIN}"}, {"x-api-key": ADMIN},
                    {"authorization": "Bearer wrong-one-0123456789", "x-api-key": KEY}):
        assert httpx.get(keyed + "/v1/models", headers=headers).status_code == 200, headers
    missing = httpx.get(keyed + "/v1/models")
    assert missing.status_code == 401 and "API key" in missing.json()["error"]["message"]


def test_read_routes_need_the_key_once_there_is_one_and_health_never_does(keyed: str, open_api: str) -> None:
    assert httpx.get(keyed + "/api/look").status_code == 401
    assert httpx.get(keyed + "/api/look", headers={"x-api-key": KEY}).status_code == 200
    assert httpx.get(open_api + "/api/look").status_code == 200
    assert httpx.get(open_api + "/v1/models").status_code == 200
    assert httpx.get(keyed + "/health").json() == {"status": "ok"}, "probes need no key, and learn no more"
    assert httpx.get(keyed + "/health", headers={"x-api-key": KEY}).json()["ready_models"] == ["tiny-llama"]


def test_management_needs_a_secret_even_without_api_keys(keyed: str, open_api: str) -> None:
    for url in (keyed, open_api):
        assert httpx.post(url + "/api/poke").status_code == 401
        assert httpx.post(url + "/api/poke", headers={"authorization": f"Bearer {ADMIN}"}).json() == {"poked": True}
    assert httpx.post(keyed + "/api/poke", headers={"x-api-key": KEY}).status_code == 200, "an API key is admin too"
    assert httpx.post(open_api + "/api/poke", headers={"x-api-key": KEY}).status_code == 401


@pytest.mark.parametrize(("method", "path"), [("post", "/api/open"), ("get", "/api/open"), ("get", "/v1/open"),
                                              ("delete", "/anything")])
def test_an_app_with_an_unguarded_route_is_refused(tiny_engine: LlamaEngine, method: str, path: str) -> None:
    router = APIRouter()
    router.add_api_route(path, lambda: {}, methods=[method.upper()])
    with pytest.raises(ConfigError, match="unguarded"):
        create_app(LocalBackend([tiny_engine]), routers=[router])


def test_plain_get_routes_outside_api_and_v1_need_no_guard(tiny_engine: LlamaEngine) -> None:
    router = APIRouter()
    router.add_api_route("/console/info", lambda: {}, methods=["GET"])
    create_app(LocalBackend([tiny_engine]), routers=[router])


@pytest.mark.parametrize("key", ["short", "has a space in it 1234", "ключ-ключ-ключ-ключ-ключ"])
def test_weak_or_unsendable_api_keys_are_refused(key: str) -> None:
    with pytest.raises(ConfigError):
        check_api_key(key)


# --- real nodes -----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def keyed_node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NodeProcess]:
    base = tmp_path_factory.mktemp("keyed")
    key_file = base / "keys"
    key_file.write_text(f"# one per line\n{KEY}\n\n")
    key_file.chmod(0o600)
    with running_nodes() as nodes:
        nodes.append(NodeProcess(base / "n", ["--client", "--api-key-file", str(key_file)], "n"))
        nodes[0].wait_ready()
        yield nodes[0]


def test_a_node_with_an_api_key_serves_only_callers_that_send_it(keyed_node: NodeProcess) -> None:
    api = keyed_node.api
    assert httpx.get(api + "/v1/models").status_code == 401
    assert httpx.get(api + "/api/status").status_code == 401
    assert httpx.get(api + "/api/events").status_code == 401
    assert openai.OpenAI(base_url=api + "/v1", api_key=KEY, max_retries=0).models.list().data == []
    assert httpx.get(api + "/health").status_code == 200
    # The CLI: with the key, or as the node's own user (its admin token), but not with neither.
    assert json.loads(meshllm("status", "--json", "--api", api, "--api-key", KEY).stdout)["name"] == "n"
    assert json.loads(meshllm("status", "--json", *keyed_node.api_args).stdout)["name"] == "n"
    refused = meshllm("models", "--api", api, "--home", str(keyed_node.home / "nowhere"))
    assert refused.returncode == 1 and "401" not in refused.stderr and "refused" in refused.stderr


def test_an_api_beyond_loopback_needs_a_key(tmp_path: Path) -> None:
    out = meshllm("serve", "--client", "--home", str(tmp_path / "x"), "--host", "0.0.0.0", "--port", "0",
                  "--mesh-port", "0", "--mesh-host", "127.0.0.1")
    assert out.returncode == 1 and "--api-key" in out.stderr and "Traceback" not in out.stderr
    out = meshllm("serve", "--client", "--home", str(tmp_path / "y"), "--api-key", "short")
    assert out.returncode == 1 and "16 characters" in out.stderr
    loose = tmp_path / "keys"
    loose.write_text(KEY)
    loose.chmod(0o644)
    out = meshllm("serve", "--client", "--home", str(tmp_path / "z"), "--api-key-file", str(loose))
    assert out.returncode == 1 and "accessible by other users" in out.stderr
