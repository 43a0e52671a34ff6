"""The blackboard on three real nodes (subprocesses through the CLI, real QUIC on 127.0.0.1)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from typing import Any

import httpx
import httpx2
import pytest
from mcp import Client
from mcp.client.streamable_http import streamable_http_client
from nodes import NodeProcess, meshllm, meshllm_json, running_nodes, wait_until

from meshllm.mesh.blackboard import RATE_PER_MINUTE

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def trio(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[NodeProcess]]:
    tmp = tmp_path_factory.mktemp("board")
    with running_nodes() as nodes:
        alpha = NodeProcess(tmp / "alpha", ["--client"], "alpha")
        nodes.append(alpha)
        token = alpha.wait_ready()["invite"]
        beta = NodeProcess(tmp / "beta", ["--client", "--member", "--join", token], "beta")
        nodes.append(beta)
        beta.wait_ready()
        gamma = NodeProcess(tmp / "gamma", ["--client", "--member", "--join", token, "--bootstrap", beta.mesh_addr],
                            "gamma")
        nodes.append(gamma)
        gamma.wait_ready()
        wait_until(lambda: all(len(n.status()["peers"]) == 2 for n in nodes), 20.0)
        yield nodes


def search(node: NodeProcess, **params: object) -> list[dict[str, object]]:
    return httpx.get(f"{node.api}/api/blackboard", params=params, timeout=5).json()["notes"]  # type: ignore[arg-type]


def test_a_note_posted_on_one_node_is_found_scrubbed_on_another_within_2_s(trio: list[NodeProcess]) -> None:
    alpha, _, gamma = trio
    text = "FINDING: tiny models load in 0.1 s; ask jo.doe@example.com, logs in /home/jo/meshllm/run.log"
    posted = meshllm_json("blackboard", text, *alpha.api_args)
    sent = time.monotonic()
    took = wait_until(lambda: any(n["id"] == posted["id"] for n in search(gamma, q="tiny models")), 2.0)
    print(f"note found on gamma {time.monotonic() - sent:.3f} s after the CLI returned (poll {took:.3f} s)")
    found = meshllm_json("blackboard", "--search", "FINDING: load", "--from", "alpha", "--since", "5m",
                         *gamma.api_args)
    assert [n["id"] for n in found] == [posted["id"]]
    note = found[0]
    assert note["author"] == alpha.node_id and note["name"] == "alpha" and note["kind"] == "FINDING"
    assert note["text"] == "FINDING: tiny models load in 0.1 s; ask [email], logs in ~/meshllm/run.log"
    received = gamma.wait_event(lambda e: e["type"] == "note_received" and e["id"] == posted["id"], 5)
    assert received["author"] == alpha.node_id
    listed = meshllm("blackboard", "--from", "alpha", *gamma.api_args)
    assert listed.returncode == 0 and "alpha: FINDING: tiny models" in listed.stdout


def test_posting_needs_the_admin_token_and_the_eleventh_note_in_a_minute_is_refused(trio: list[NodeProcess]) -> None:
    beta = trio[1]
    anonymous = httpx.post(f"{beta.api}/api/blackboard", json={"text": "STATUS: hi"}, timeout=5)
    assert anonymous.status_code == 401
    unknown = httpx.post(f"{beta.api}/api/blackboard", json={"text": "STATUS: hi", "ttl": 5},
                         headers=beta.admin_headers, timeout=5)
    assert unknown.status_code == 400 and "ttl" in unknown.text
    for i in range(RATE_PER_MINUTE):
        ok = httpx.post(f"{beta.api}/api/blackboard", json={"text": f"STATUS: step {i}"},
                        headers=beta.admin_headers, timeout=5)
        assert ok.status_code == 200, ok.text
    done = meshllm("blackboard", "STATUS: one too many", *beta.api_args)
    assert done.returncode != 0 and "10 notes in the last minute" in done.stderr
    big = meshllm("blackboard", "x" * 5000, *beta.api_args)
    assert big.returncode != 0 and "4 KB" in big.stderr
    mixed = meshllm("blackboard", "STATUS: hi", "--search", "x", *beta.api_args)
    assert mixed.returncode == 2 and "cannot go with a MESSAGE" in mixed.stderr
    assert "Traceback" not in done.stderr + big.stderr + mixed.stderr


async def mcp_post(node: NodeProcess, text: str) -> dict[str, Any]:
    async with httpx2.AsyncClient(headers=node.admin_headers, timeout=30) as http, \
            Client(streamable_http_client(f"{node.api}/mcp", http_client=http)) as client:
        result = await client.call_tool("blackboard_post", {"text": text})
        assert not result.is_error, result
        return dict(result.structured_content or {})


def test_a_note_posted_by_an_agent_over_mcp_reaches_every_member(trio: list[NodeProcess]) -> None:
    alpha, beta, gamma = trio
    posted = asyncio.run(mcp_post(gamma, "TIP: ask the mesh with the ask tool"))
    wait_until(lambda: all(any(n["id"] == posted["id"] for n in search(node, q="ask tool")) for node in (alpha, beta)),
               2.0)
