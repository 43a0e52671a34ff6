"""Garbage QUIC Initials cannot hold a node's pending-handshake slots.

Finding: garbage Initials at 200-1,000 packets/s held all 256 pending-handshake slots (10 s each),
so 3-4 of 4 new joins failed. An Initial that does not decrypt now leaves no state behind.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from attacker import InitialFlood
from nodes import NodeProcess, running_nodes, sees, wait_until

pytestmark = pytest.mark.timeout(120)

RATE = 1000.0
JOINERS = 4


def test_new_nodes_join_during_a_garbage_initial_flood(tmp_path: Path) -> None:
    with running_nodes() as nodes:
        a = NodeProcess(tmp_path / "a", ["--client"], "a")
        nodes.append(a)
        token = a.wait_ready()["invite"]
        with InitialFlood(a.mesh_addr, RATE) as flood:
            wait_until(lambda: flood.sent > RATE * 2, 10.0)  # slots would be full by now
            joiners = [NodeProcess(tmp_path / f"j{i}", ["--client", "--member", "--join", token], f"j{i}")
                       for i in range(JOINERS)]
            nodes.extend(joiners)
            ready = 0
            for joiner in joiners:
                try:
                    joiner.wait_ready(30.0)
                    ready += 1
                except AssertionError:
                    pass
            print(f"{ready} of {JOINERS} joins succeeded under {flood.sent} garbage Initials")
            assert ready == JOINERS
            wait_until(lambda: all(sees(a, j.node_id) for j in joiners), 10.0)
        assert a.proc.poll() is None
