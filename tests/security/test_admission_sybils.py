"""One member cannot flood every view with node ids of its own making.

Finding: 1,500 fake-id records pushed by one member grew the owner by ~100 MB and pushed B's chat
latency from 0.05 to 1.8 s. A member can still vouch for nodes (its grants are genuine), but every
such node is attributable to it, at most ADMISSIONS_PER_MEMBER of them count anywhere, and revoking
the member removes them all.
"""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest
from attacker import Attacker, rss_mb
from nodes import NodeProcess, meshllm_json, wait_until

from meshllm.mesh.admission import ADMISSIONS_PER_MEMBER
from meshllm.mesh.messages import Exchange

pytestmark = pytest.mark.timeout(180)

FAKES = 1500
PER_MESSAGE = 16
"""Records per Exchange: a member holding few peers verifies only a few more than it holds."""


def peer_names(node: NodeProcess) -> set[str]:
    return {p["name"] for p in node.status(timeout=10)["peers"] if p["state"] in ("alive", "suspect")}


def test_fake_ids_pushed_by_one_member_are_bounded_and_go_with_it(pair: tuple[NodeProcess, NodeProcess]) -> None:
    a, b = pair
    baseline = rss_mb(a.proc.pid)

    async def attack() -> str:
        mallory = Attacker(a.ready["invite"])
        await mallory.start()
        # Forging takes seconds of CPU: off the loop, so our own connection keeps being served.
        records = await asyncio.to_thread(lambda: [mallory.forge_member(a.ready["invite"], f"fake{i}")
                                                   for i in range(FAKES)])
        conn = await mallory.connect(a.mesh_addr)
        for i in range(0, FAKES, PER_MESSAGE):
            await mallory.send_gossip(conn, Exchange(records[i:i + PER_MESSAGE]))
        await asyncio.sleep(3.0)
        return mallory.node_id  # mallory stays: its revocation below must take its fakes along

    loop = asyncio.new_event_loop()
    try:
        mallory_id = loop.run_until_complete(attack())
        fakes = {n for n in peer_names(a) if n.startswith("fake")}
        at_b = {n for n in peer_names(b) if n.startswith("fake")}
        grown = rss_mb(a.proc.pid) - baseline
        start = time.monotonic()
        httpx.get(f"{b.api}/api/status", timeout=10)
        latency = time.monotonic() - start
        print(f"fake ids held: A {len(fakes)}, B {len(at_b)} of {FAKES}; A grew {grown:.0f} MB; "
              f"B answers in {latency * 1000:.0f} ms")
        assert len(fakes) <= ADMISSIONS_PER_MEMBER and len(at_b) <= ADMISSIONS_PER_MEMBER
        assert grown < 40
        meshllm_json("mesh", "revoke-node", mallory_id, *a.api_args)
        wait_until(lambda: not any(n.startswith("fake") for n in peer_names(a) | peer_names(b)), 10.0)
    finally:
        loop.close()
