"""``meshllm serve/join/invite --api/status`` against real running nodes, as a user runs them."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from nodes import NodeProcess, meshllm, running_nodes, wait_until

from meshllm.mesh.admission import MeshKey, encode_token

pytestmark = pytest.mark.timeout(120)




@pytest.fixture(scope="module")
def trio(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[NodeProcess]]:
    """Three running nodes (alpha owns the mesh) that see each other."""
    base = tmp_path_factory.mktemp("trio")
    with running_nodes() as nodes:
        nodes.append(NodeProcess(base / "alpha", ["--client"], "alpha"))
        token = nodes[0].wait_ready()["invite"]
        for name in ("beta", "gamma"):
            nodes.append(NodeProcess(base / name, ["--client", "--member", "--join", token], name))
        for node in nodes:
            node.wait_ready()
        wait_until(lambda: all(len([p for p in n.status()["peers"] if p["rtt_ms"] is not None]) == 2
                               and len(n.status()["rtt_matrix"]) == 3 for n in nodes), 15.0)
        yield nodes


def test_invite_from_the_running_owner(trio: list[NodeProcess]) -> None:
    out = meshllm("invite", "create", *trio[0].api_args, "--ttl", "1h", "--uses", "2")
    assert out.returncode == 0, out.stderr
    info = json.loads(meshllm("invite", "inspect", out.stdout.strip(), "--json").stdout)
    assert info["mesh_id"] == trio[0].ready["mesh_id"] and info["max_uses"] == 2
    assert info["bootstrap"] == [trio[0].mesh_addr]


def test_invite_from_a_member_that_is_not_the_owner_is_a_clear_error(trio: list[NodeProcess]) -> None:
    out = meshllm("invite", "create", *trio[1].api_args)
    assert out.returncode == 1 and "mesh key" in out.stderr and "Traceback" not in out.stderr


def test_status_json_snapshot(trio: list[NodeProcess]) -> None:
    out = meshllm("status", "--json", "--api", trio[1].api)
    assert out.returncode == 0, out.stderr
    snap = json.loads(out.stdout)
    assert snap["name"] == "beta" and snap["mesh_id"] == trio[0].ready["mesh_id"]
    assert {p["name"] for p in snap["peers"]} == {"alpha", "gamma"}
    assert all(p["path"] == "direct" and p["rtt_ms"] is not None for p in snap["peers"])
    assert len(snap["rtt_matrix"]) == 3


@pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed (.ci/run installs it)")
def test_status_dashboard_in_tmux_shows_peers_and_matrix(trio: list[NodeProcess], tmp_path: Path) -> None:
    sock = str(tmp_path / "tmux.sock")
    cmd = f"{sys.executable} -m meshllm status --api {trio[0].api}"
    subprocess.run(["tmux", "-S", sock, "new-session", "-d", "-x", "120", "-y", "40", cmd], check=True)
    try:
        def screen() -> str:
            return subprocess.run(["tmux", "-S", sock, "capture-pane", "-p"], capture_output=True, text=True).stdout

        wait_until(lambda: "gamma" in screen() and "RTT matrix" in screen(), 15.0, interval=0.2)
        text = screen()
        assert "alpha" in text and "beta" in text and "alive" in text
        subprocess.run(["tmux", "-S", sock, "send-keys", "q"], check=True)
        wait_until(lambda: subprocess.run(["tmux", "-S", sock, "has-session"], capture_output=True).returncode != 0,
                   10.0, interval=0.2)
    finally:
        subprocess.run(["tmux", "-S", sock, "kill-server"], capture_output=True)


def test_join_with_an_expired_invite_fails_fast_with_one_line(trio: list[NodeProcess], tmp_path: Path) -> None:
    # An invite signed by a different mesh key than alpha's, pointing at alpha: alpha refuses it.
    other = encode_token(MeshKey.generate().invite(time.time(), bootstrap=[trio[0].mesh_addr]))
    started = time.monotonic()
    out = meshllm("join", other, "--home", str(tmp_path / "x"), "--client", "--port", "0", "--mesh-port", "0",
                  "--mesh-host", "127.0.0.1")
    assert out.returncode == 1, out.stderr
    assert "error:" in out.stderr and "Traceback" not in out.stderr
    assert time.monotonic() - started < 20


def test_join_with_garbage_token_is_one_line(tmp_path: Path) -> None:
    out = meshllm("join", "not-a-token", "--home", str(tmp_path / "y"))
    assert out.returncode == 1 and out.stderr.startswith("error: ") and "Traceback" not in out.stderr


def test_second_node_on_a_busy_api_port_says_what_to_do(trio: list[NodeProcess], tmp_path: Path) -> None:
    port = trio[0].api.rsplit(":", 1)[1]
    out = meshllm("serve", "--client", "--home", str(tmp_path / "z"), "--port", port, "--mesh-port", "0",
                  "--mesh-host", "127.0.0.1")
    assert out.returncode == 1 and "--port" in out.stderr and "Traceback" not in out.stderr


def test_second_node_on_a_busy_mesh_port_says_what_to_do(tmp_path: Path) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as busy:
        busy.bind(("127.0.0.1", 0))
        port = str(busy.getsockname()[1])
        out = meshllm("serve", "--client", "--home", str(tmp_path / "m"), "--port", "0", "--mesh-port", port,
                      "--mesh-host", "127.0.0.1")
    assert out.returncode == 1 and "--mesh-port" in out.stderr and "internal error" not in out.stderr, out.stderr


def test_event_stream_replays_history_then_streams_live_events(trio: list[NodeProcess], tmp_path: Path) -> None:
    from meshllm.cli.api_client import NodeApi

    with NodeApi(trio[0].api, trio[0].admin_token).events(idle_timeout=10.0) as events:
        seen = []
        for event in events:
            seen.append(event)
            if event["type"] == "peer_joined" and event["node_id"] == trio[2].node_id:
                break
        else:
            pytest.fail("the stream ended without gamma's peer_joined event")
        assert any(e["type"] == "ready" for e in seen), "history starts with the node's own events"
        # A live event: a fourth node joins and leaves.
        extra = NodeProcess(tmp_path / "delta", ["--client", "--member", "--join", trio[0].ready["invite"]], "delta")
        try:
            extra.wait_ready()
            for event in events:
                if event["type"] == "peer_joined" and event["node_id"] == extra.node_id:
                    break
            else:
                pytest.fail("no live peer_joined event for delta")
            extra.terminate()
            for event in events:
                if event["type"] == "peer_left" and event["node_id"] == extra.node_id:
                    assert event["reason"] == "left"
                    break
            else:
                pytest.fail("no live peer_left event for delta")
        finally:
            extra.kill()


def test_revoked_invite_cannot_join_and_only_the_owner_revokes(trio: list[NodeProcess], tmp_path: Path) -> None:
    token = meshllm("invite", "create", *trio[0].api_args, "--ttl", "1h").stdout.strip()
    invite_id = json.loads(meshllm("invite", "inspect", token, "--json").stdout)["invite_id"]
    out = meshllm("invite", "revoke", token, *trio[0].api_args)
    assert out.returncode == 0, out.stderr
    assert f"revoked invite {invite_id}" in out.stdout
    out = meshllm("invite", "revoke", invite_id, *trio[0].api_args, "--json")  # by id, again: harmless
    assert out.returncode == 0 and json.loads(out.stdout)["target"] == invite_id
    # The revocation reached the other members (the owner logs it; so do they).
    for node in trio[1:]:
        node.wait_event(lambda e: e["type"] == "revoked" and e.get("target") == invite_id, 10.0)
    started = time.monotonic()
    out = meshllm("join", token, "--home", str(tmp_path / "r"), "--client", "--port", "0", "--mesh-port", "0",
                  "--mesh-host", "127.0.0.1")
    assert out.returncode == 1, out.stderr
    lines = [ln for ln in out.stderr.splitlines() if ln.startswith("error:")]
    assert len(lines) == 1 and "revoked" in out.stderr and "Traceback" not in out.stderr
    assert time.monotonic() - started < 20
    # A member that does not hold the mesh key answers 409; a bad node id is 422.
    out = meshllm("mesh", "revoke-node", trio[0].node_id, *trio[1].api_args)
    assert out.returncode == 1 and "mesh key" in out.stderr and "409" in out.stderr
    out = meshllm("mesh", "revoke-node", "not-a-node-id", *trio[0].api_args)
    assert out.returncode == 1 and "422" in out.stderr and "Traceback" not in out.stderr
    assert "revoked" not in {p["state"] for p in trio[0].status()["peers"]}
