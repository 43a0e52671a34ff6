"""The node's MCP server at /mcp, through the official ``mcp`` client, against a real node serving a tiny model."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from typing import Any

import httpx
import httpx2
import pytest
from mcp import Client
from mcp.client.streamable_http import streamable_http_client
from mcp.shared.exceptions import MCPError
from nodes import NodeProcess, running_nodes
from tinymodels import write_tiny_llama

pytestmark = pytest.mark.timeout(120)

TOOLS = {"blackboard_post", "blackboard_search", "blackboard_feed", "mesh_status", "mesh_models", "ask"}


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NodeProcess]:
    tmp = tmp_path_factory.mktemp("mcp")
    write_tiny_llama(tmp / "tiny.gguf")
    with running_nodes() as nodes:
        alpha = NodeProcess(tmp / "home", ["--model", str(tmp / "tiny.gguf")], "alpha")
        nodes.append(alpha)
        alpha.wait_ready()
        yield alpha


async def session(node: NodeProcess, token: str | None, calls: list[tuple[str, dict[str, Any]]]) -> Any:
    """List the tools, then run ``calls`` in order; the tool names and each call's structured result."""
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    async with httpx2.AsyncClient(headers=headers, timeout=30) as http, \
            Client(streamable_http_client(f"{node.api}/mcp", http_client=http)) as client:
        names = {t.name for t in (await client.list_tools()).tools}
        results = []
        for name, args in calls:
            result = await client.call_tool(name, args)
            text = "".join(getattr(c, "text", "") for c in result.content)
            results.append({"error": text} if result.is_error else (result.structured_content or json.loads(text)))
        return names, results


def test_an_mcp_client_lists_the_tools_posts_searches_and_asks_a_mesh_model(node: NodeProcess) -> None:
    names, (posted, found, feed, status, models, answer, auto, refused) = asyncio.run(session(node, node.admin_token, [
        ("blackboard_post", {"text": "TIP: mcp works; ping me at ops@example.net"}),
        ("blackboard_search", {"query": "TIP: mcp", "since_hours": 1}),
        ("blackboard_feed", {"limit": 5}),
        ("mesh_status", {}),
        ("mesh_models", {}),
        ("ask", {"model": "tiny", "prompt": "Say hello", "max_tokens": 8, "temperature": 0}),
        ("ask", {"model": "auto", "prompt": "Say hello", "max_tokens": 2}),
        ("blackboard_post", {"text": "x" * 5000}),
    ]))
    assert names >= TOOLS
    assert posted["text"] == "TIP: mcp works; ping me at [email]" and posted["author"] == node.node_id
    assert [n["id"] for n in found["notes"]] == [posted["id"]]
    assert feed["notes"][0]["id"] == posted["id"]
    assert status["node_id"] == node.node_id and status["nodes"][0]["models"] == ["tiny"]
    assert [m["id"] for m in models["models"]] == ["tiny"]
    assert answer["model"] == "tiny" and answer["finish_reason"] == "length"
    assert answer["usage"]["completion_tokens"] == 8
    assert auto["model"] == "tiny" and auto["usage"]["completion_tokens"] == 2  # the mesh's one model
    assert node.wait_event(lambda e: e["type"] == "auto_routed", 5)["model"] == "tiny"
    assert "too-large" in refused["error"] and "4 KB" in refused["error"]
    # the note is on the blackboard for everyone else too
    listed = httpx.get(f"{node.api}/api/blackboard", params={"q": "mcp"}, timeout=5).json()["notes"]
    assert [n["id"] for n in listed] == [posted["id"]]


@pytest.mark.parametrize("token", [None, "not-the-token-0123456789"])
def test_without_the_admin_token_or_an_api_key_mcp_is_refused(node: NodeProcess, token: str | None) -> None:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    body = {"jsonrpc": "2.0", "id": 1, "method": "tools/list", "params": {}}
    accept = {"Accept": "application/json, text/event-stream"}
    answer = httpx.post(f"{node.api}/mcp", json=body, headers={**headers, **accept}, timeout=5)
    assert answer.status_code == 401 and answer.json()["error"]["code"] == "invalid_api_key"
    with pytest.raises(BaseExceptionGroup) as failed:  # the SDK's client fails at its first request
        asyncio.run(session(node, token, []))
    assert [type(e) for e in flatten(failed.value)] == [MCPError], failed.value


def flatten(exc: BaseException) -> list[BaseException]:
    inner = getattr(exc, "exceptions", None)
    return [exc] if inner is None else [e for sub in inner for e in flatten(sub)]


def test_the_admin_token_reaches_mcp_with_a_plain_json_rpc_call(node: NodeProcess) -> None:
    accept = {"Accept": "application/json, text/event-stream", **node.admin_headers}
    client = {"name": "t", "version": "1"}
    init = {"jsonrpc": "2.0", "id": 1, "method": "initialize",
            "params": {"protocolVersion": "2025-06-18", "capabilities": {}, "clientInfo": client}}
    answer = httpx.post(f"{node.api}/mcp", json=init, headers=accept, timeout=5)
    assert answer.status_code == 200 and answer.json()["result"]["serverInfo"]["name"] == "meshllm"
