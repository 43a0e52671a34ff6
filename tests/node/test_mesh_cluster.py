"""Five real nodes on 127.0.0.1, started through the CLI: convergence, a killed node, a graceful leave.

Timing targets (3 s to converge, 5 s to drop a killed node, 1 s to see a leave) are asserted
loosely here, because CI machines are shared and noisy; bench/mesh.py reports medians.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from nodes import NodeProcess, running_nodes, wait_until

pytestmark = pytest.mark.timeout(180)


def full_view(node: NodeProcess, others: list[NodeProcess]) -> bool:
    """``node`` lists every other node alive with an RTT, and holds a full RTT matrix."""
    status = node.status()
    peers = {p["node_id"]: p for p in status["peers"] if p["state"] == "alive"}
    if set(peers) != {o.node_id for o in others} or any(p["rtt_ms"] is None for p in peers.values()):
        return False
    matrix = status["rtt_matrix"]
    ids = {node.node_id, *peers}
    return set(matrix) >= ids and all(set(matrix[a]) >= ids - {a} for a in ids)


def sees(node: NodeProcess, other: NodeProcess) -> bool:
    return any(p["node_id"] == other.node_id and p["state"] in ("alive", "suspect")
               for p in node.status()["peers"])


def test_five_nodes_converge_then_drop_a_killed_node_and_see_a_leave(tmp_path: Path) -> None:
    with running_nodes() as nodes:
        creator = NodeProcess(tmp_path / "n0", ["--client"], "n0")
        nodes.append(creator)
        token = creator.wait_ready()["invite"]
        nodes.append(NodeProcess(tmp_path / "n1", ["--client", "--member", "--join", token], "n1"))
        nodes[1].wait_ready()
        # n2..n4 dial n1, a member other than the creator.
        for i in range(2, 5):
            nodes.append(NodeProcess(tmp_path / f"n{i}", ["--client", "--member", "--join", token, "--bootstrap",
                                                          nodes[1].mesh_addr], f"n{i}"))
        for node in nodes:
            node.wait_ready()
        assert {n.ready["mesh_id"] for n in nodes} == {creator.ready["mesh_id"]}

        converged = wait_until(lambda: all(full_view(n, [o for o in nodes if o is not n]) for n in nodes), 10.0)
        print(f"converged {converged:.2f} s after the last node was ready")
        assert converged < 6.0

        victim = nodes[2]
        killed_at = time.monotonic()
        victim.kill()
        survivors = [n for n in nodes if n is not victim]
        dropped = wait_until(lambda: not any(sees(n, victim) for n in survivors), 15.0)
        print(f"killed node dropped by every survivor in {dropped:.2f} s")
        assert dropped < 8.0
        # changed_s dates each verdict: every survivor turned the victim down after the kill.
        for n in survivors:
            peers = {p["node_id"]: p for p in n.status()["peers"]}
            since_kill = time.monotonic() - killed_at
            assert peers[victim.node_id]["state"] == "down"
            assert 0 < peers[victim.node_id]["changed_s"] < since_kill + 0.01
        assert all(n.proc.poll() is None for n in survivors), "a survivor crashed"

        leaver = nodes[4]
        leaver.terminate()
        remaining = [n for n in survivors if n is not leaver]
        left = wait_until(lambda: not any(sees(n, leaver) for n in remaining), 5.0)
        print(f"graceful leave seen by every node in {left:.2f} s")
        assert left < 2.0
        assert leaver.proc.returncode == 0
        assert any(e["type"] == "peer_left" and e["node_id"] == leaver.node_id for e in remaining[0].events)
