"""Serving across real nodes (subprocesses through the CLI, real QUIC and llama.cpp on 127.0.0.1).

A node serves a tiny test GGUF; a ``--client`` node that serves nothing answers the same OpenAI
requests by routing them over the mesh. Failures: the serving node killed mid-stream, requests
after its death, and failover when the preferred peer dies before answering.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from nodes import NodeProcess, meshllm, meshllm_json, running_nodes, wait_until
from tinymodels import write_tiny_llama

from meshllm.runtime.mesh_backend import START_WAIT_S, TunnelDeadlines
from meshllm.runtime.router import rendezvous_score

pytestmark = pytest.mark.timeout(120)

MODEL = "tiny"
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hello."}]


@pytest.fixture(scope="module")
def gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_llama(tmp_path_factory.mktemp("models") / f"{MODEL}.gguf", seed=0)


def client_of(node: NodeProcess, timeout: float = 30.0) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{node.api}/v1", api_key="unused", max_retries=0, timeout=timeout)


def serving_nodes(node: NodeProcess) -> list[str]:
    """Ids of the nodes ``node``'s API lists as serving the tiny model."""
    data = httpx.get(f"{node.api}/v1/models", timeout=5).json()["data"]
    return next((m["nodes"] for m in data if m["id"] == MODEL), [])


def start_mesh(tmp: Path, servers: int, gguf: Path, nodes: list[NodeProcess]) -> tuple[list[NodeProcess], NodeProcess]:
    """``servers`` nodes serving ``gguf`` plus one ``--client`` node; wait until the client sees them all."""
    first = NodeProcess(tmp / "s0", ["--model", str(gguf)], "s0")
    nodes.append(first)
    token = first.wait_ready()["invite"]
    rest = [NodeProcess(tmp / f"s{i}", ["--model", str(gguf), "--join", token], f"s{i}") for i in range(1, servers)]
    client = NodeProcess(tmp / "client", ["--client", "--join", token], "client")
    nodes.extend([*rest, client])
    for node in [*rest, client]:
        node.wait_ready()
    wait_until(lambda: len(serving_nodes(client)) == servers, 15.0)
    return [first, *rest], client


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory, gguf: Path) -> Iterator[tuple[NodeProcess, NodeProcess]]:
    """Node A serving the tiny model and client node B joined to it."""
    with running_nodes() as nodes:
        servers, client = start_mesh(tmp_path_factory.mktemp("pair"), 1, gguf, nodes)
        yield servers[0], client


def test_client_node_lists_the_mesh_models(pair: tuple[NodeProcess, NodeProcess]) -> None:
    a, b = pair
    models = client_of(b).models.list().data
    assert [m.id for m in models] == [MODEL, "auto"]
    assert models[0].model_extra is not None
    assert models[0].model_extra["nodes"] == [a.node_id] and models[0].model_extra["node_names"] == ["s0"]
    assert models[0].model_extra["context_length"] == 2048


def test_models_command_lists_local_and_mesh_models(pair: tuple[NodeProcess, NodeProcess]) -> None:
    a, b = pair
    for node, local in ((a, True), (b, False)):
        assert meshllm_json("models", "--api", node.api, timeout=20)["served"] == [{"id": MODEL, "context_length": 2048,
                                    "nodes": [{"id": a.node_id, "name": "s0", "local": local}]}]
    done = meshllm("models", "--api", a.api, timeout=20)
    assert done.returncode == 0, done.stderr
    table = done.stdout
    assert MODEL in table and "s0 (this node)" in table


def test_routed_chat_and_completion_match_the_serving_node(pair: tuple[NodeProcess, NodeProcess]) -> None:
    a, b = pair
    direct, routed = client_of(a), client_of(b)
    replies = [c.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=24, seed=11)  # type: ignore[arg-type]
               for c in (direct, routed)]
    assert replies[0].choices[0].message.content == replies[1].choices[0].message.content
    assert replies[1].choices[0].message.content
    assert replies[0].usage is not None and replies[1].usage is not None
    # the same counts; only the cached part of the prompt differs (the second reuses the first's prefix)
    assert replies[0].usage.model_dump(exclude={"prompt_tokens_details"}) == \
        replies[1].usage.model_dump(exclude={"prompt_tokens_details"})
    assert replies[1].usage.completion_tokens <= 24
    assert replies[1].usage.total_tokens == replies[1].usage.prompt_tokens + replies[1].usage.completion_tokens

    chunks = list(routed.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=24, seed=11,  # type: ignore[arg-type]
                                                 stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == \
        replies[0].choices[0].message.content
    assert chunks[-1].usage is not None
    assert chunks[-1].usage.model_dump(exclude={"prompt_tokens_details"}) == \
        replies[0].usage.model_dump(exclude={"prompt_tokens_details"})

    texts = []
    for c in (direct, routed):
        reply = c.completions.create(model=MODEL, prompt="Once upon", max_tokens=16, temperature=0)
        assert reply.usage is not None and reply.usage.completion_tokens == 16
        texts.append(reply.choices[0].text)
    streamed = routed.completions.create(model=MODEL, prompt="Once upon", max_tokens=16, temperature=0, stream=True)
    assert texts[0] == texts[1] == "".join(c.choices[0].text for c in streamed)

    counters = b.status()["requests"]
    assert counters["total"] >= 4 and counters["remote"] == counters["total"] and counters["failed"] == 0
    assert a.status()["requests"]["served_for_peers"] >= 4
    with pytest.raises(openai.NotFoundError):
        routed.chat.completions.create(model="nope", messages=MESSAGES)  # type: ignore[arg-type]


def test_client_disconnect_stops_the_remote_generation(pair: tuple[NodeProcess, NodeProcess]) -> None:
    """The serving engine runs one request at a time: a generation left running would hold the next."""
    a, b = pair
    stream = client_of(b).completions.create(model=MODEL, prompt="a", max_tokens=2000, temperature=0, stream=True)
    for i, _chunk in enumerate(stream):
        if i == 5:
            break
    stream.close()
    started = time.monotonic()
    reply = client_of(a, timeout=10).completions.create(model=MODEL, prompt="b", max_tokens=4, temperature=0)
    assert reply.choices[0].text is not None and time.monotonic() - started < 3.0  # 2000 tokens would take ~15 s


def test_serving_node_killed_mid_stream(tmp_path: Path, gguf: Path) -> None:
    """The client's stream ends with an error event within 2 s; a new request gets its 503 once gossip has
    the node down, or once it has had START_WAIT_S to answer again (a dead node looks slow for that long)."""
    with running_nodes() as nodes:
        (a,), b = start_mesh(tmp_path, 1, gguf, nodes)
        stream = client_of(b).completions.create(model=MODEL, prompt="a", max_tokens=2000, temperature=0, stream=True)
        received = 0
        killed_at = 0.0
        with pytest.raises(openai.APIError) as caught:
            for _chunk in stream:
                received += 1
                if received == 10:
                    a.kill()
                    killed_at = time.monotonic()
        ended = time.monotonic() - killed_at
        print(f"stream error {ended:.2f} s after kill -9, after {received} chunks: {caught.value}")
        assert killed_at and ended < 2.0
        assert "unreachable" in str(caught.value)

        with pytest.raises(openai.InternalServerError) as refused:
            client_of(b, timeout=30).chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4)  # type: ignore[arg-type]
        after_kill = time.monotonic() - killed_at
        print(f"503 {after_kill:.2f} s after kill -9: {refused.value}")
        assert refused.value.status_code == 503 and after_kill < 4.0 + START_WAIT_S + TunnelDeadlines.connect_s
        assert b.proc.poll() is None


def test_failover_when_the_affinity_peer_dies_before_answering(tmp_path: Path, gguf: Path) -> None:
    with running_nodes() as nodes:
        servers, client = start_mesh(tmp_path, 2, gguf, nodes)
        owner = max(servers, key=lambda s: (rendezvous_score("user:session-1", s.node_id), s.node_id))
        other = next(s for s in servers if s is not owner)
        owner.kill()  # the client has not noticed yet: the owner is still its first choice
        started = time.monotonic()
        reply = client_of(client).chat.completions.create(
            model=MODEL, messages=MESSAGES, max_tokens=8, seed=3, user="session-1")  # type: ignore[arg-type]
        took = time.monotonic() - started
        print(f"failed over from the killed owner and answered in {took:.2f} s")
        assert reply.choices[0].message.content and took < 5.0
        failover = client.wait_event(lambda e: e["type"] == "request_failover", 1.0)
        assert failover["node_id"] == owner.node_id
        assert other.status()["requests"]["served_for_peers"] == 1
