"""A ``--client`` node that joins routes, fails over and replays from pulled route tables, and members hold
nothing about it: real nodes over QUIC on 127.0.0.1, the tiny llama on two of them."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from nodes import NodeProcess, running_nodes, sees, wait_until
from tinymodels import write_tiny_llama

from meshllm.mesh.messages import HEALTH_MAX

pytestmark = pytest.mark.timeout(180)

MODEL = "tiny"


def serving(node: NodeProcess) -> list[str]:
    data = httpx.get(f"{node.api}/v1/models", timeout=5).json()["data"]
    return next((m["nodes"] for m in data if m["id"] == MODEL), [])


@pytest.fixture
def mesh(tmp_path: Path) -> Iterator[tuple[NodeProcess, NodeProcess, NodeProcess]]:
    """(A1 owner serving, A2 serving, passive client C pulling every second)."""
    gguf = write_tiny_llama(tmp_path / f"{MODEL}.gguf", seed=3)
    serve = ["--model", str(gguf), "--threads", "1"]
    with running_nodes() as nodes:
        a1 = NodeProcess(tmp_path / "a1", serve, "a1")
        nodes.append(a1)
        token = a1.wait_ready()["invite"]
        a2 = NodeProcess(tmp_path / "a2", [*serve, "--join", token], "a2")
        nodes.append(a2)
        a2.wait_ready()
        c = NodeProcess(tmp_path / "c", ["--client", "--routes-interval", "1", "--join", token], "c")
        nodes.append(c)
        c.wait_ready()
        wait_until(lambda: len(serving(c)) == 2, 30.0)
        yield a1, a2, c


def test_passive_client_routes_and_members_hold_nothing_about_it(
        mesh: tuple[NodeProcess, NodeProcess, NodeProcess]) -> None:
    a1, a2, c = mesh
    chat = openai.OpenAI(base_url=f"{c.api}/v1", api_key="x", max_retries=0, timeout=60)
    answer = chat.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=8)
    assert answer.choices[0].finish_reason in ("length", "stop")
    # the client's view came from a signed table; members list each other and never the client
    assert c.wait_event(lambda e: e["type"] == "routes_updated", 5.0)["nodes"] == 2
    assert {p["node_id"] for p in c.status()["peers"]} == {a1.node_id, a2.node_id}
    for member in (a1, a2):
        assert c.node_id not in {p["node_id"] for p in member.status()["peers"]}
        assert not any(e["type"] == "peer_joined" and e.get("node_id") == c.node_id for e in member.events)


def test_passive_client_drops_a_killed_node_and_routes_to_the_other(
        mesh: tuple[NodeProcess, NodeProcess, NodeProcess]) -> None:
    a1, a2, c = mesh
    a2.kill()
    wait_until(lambda: not sees(c, a2.node_id), 15.0)
    chat = openai.OpenAI(base_url=f"{c.api}/v1", api_key="x", max_retries=0, timeout=60)
    for _ in range(3):
        answer = chat.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4)
        assert answer.choices
    assert serving(c) == [a1.node_id]


def test_member_is_for_a_client(tmp_path: Path) -> None:
    from nodes import meshllm

    out = meshllm("serve", "--member", "--home", str(tmp_path / "x"), "--port", "0", "--mesh-port", "0")
    assert out.returncode != 0
    assert "--member is for a --client" in out.stderr
    assert "Traceback" not in out.stderr


def test_a_passive_client_takes_an_invite_use_and_comes_back_on_its_credential(tmp_path: Path) -> None:
    """``invite create --uses 1``: one passive client joins with it; a second is refused in one line; the first
    restarts on the credential it keeps in its home."""
    from nodes import meshllm

    with running_nodes() as nodes:
        owner = NodeProcess(tmp_path / "owner", ["--client"], "owner")
        nodes.append(owner)
        owner.wait_ready()
        made = meshllm("invite", "create", *owner.api_args, "--uses", "1")
        assert made.returncode == 0, made.stderr
        token = made.stdout.strip()
        first = NodeProcess(tmp_path / "p1", ["--client", "--join", token], "p1")
        nodes.append(first)
        first.wait_ready()
        status = first.status()
        assert status["passive"] and status["anchors"] == [owner.node_id]
        assert status["local_health"] is None  # no failure detector: it probes nobody
        assert 0 <= owner.status()["local_health"] <= HEALTH_MAX
        refused = meshllm("join", token, "--client", "--home", str(tmp_path / "p2"), "--port", "0",
                          "--mesh-port", "0", "--mesh-host", "127.0.0.1")
        assert refused.returncode == 1 and "already used" in refused.stderr, refused.stderr
        assert "Traceback" not in refused.stderr
        assert first.terminate() == 0
        again = NodeProcess(tmp_path / "p1", ["--client", "--join", token], "p1")
        nodes.append(again)
        assert again.wait_ready()["node_id"] == first.node_id
        assert first.node_id not in [p["node_id"] for p in owner.status()["peers"]]


def test_an_idle_passive_client_follows_a_leave_on_its_anchors_hint(tmp_path: Path) -> None:
    """An idle client pulls at ever longer intervals (2 s after a change, doubling up to a minute); a member
    that sees the mesh change sends its passive clients a hint, so the client drops a member that left
    long before its next pull. The member that leaves is one the client holds no connection to, so no
    closed connection tells the client anything."""
    with running_nodes() as nodes:
        owner = NodeProcess(tmp_path / "m0", ["--client"], "m0")
        nodes.append(owner)
        token = owner.wait_ready()["invite"]
        members = [owner]
        for i in (1, 2):
            members.append(NodeProcess(tmp_path / f"m{i}", ["--client", "--member", "--join", token], f"m{i}"))
            nodes.append(members[-1])
            members[-1].wait_ready()
        c = NodeProcess(tmp_path / "c", ["--client", "--join", token], "c")
        nodes.append(c)
        c.wait_ready()
        wait_until(lambda: all(sees(c, m.node_id) for m in members), 30.0)
        wait_until(lambda: c.status()["route_pulls"]["next_s"] > 6.0, 60.0, interval=0.2)
        status, read_at = c.status(), time.monotonic()
        scheduled = read_at + status["route_pulls"]["next_s"]
        victim = next(m for m in members if m.node_id in
                      {p["node_id"] for p in status["peers"] if p["path"] == "none"})
        anchor = next(m for m in members if m.node_id == status["anchors"][0])
        hints = anchor.status()["route_tables"]["hints"]
        assert victim.terminate() == 0
        wait_until(lambda: not sees(c, victim.node_id), max(0.5, scheduled - time.monotonic() - 0.5), interval=0.1)
        assert time.monotonic() < scheduled, "the client learned it from its scheduled pull, not the hint"
        assert anchor.status()["route_tables"]["hints"] > hints
