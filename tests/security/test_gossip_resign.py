"""Valid gossip at the maximum rate: a member re-signing its vouched identities' records is limited.

Finding (issue 29): one member re-signing its 32 vouched identities' records (about 26 KB each) every
second for 60 s: 1,920 records accepted, no strikes, 41 % of a core at A, chat latency 0.15 ->
0.43 s. Every record was genuine, so no limit applied. Now new records are rate-limited per node id
(2 a second, bursts of 20) and, together, per member that vouched for them (4 a second, bursts of
40); a member sending more of its own or its identities' records is struck, and cooled.
"""

from __future__ import annotations

import asyncio
import time

import pytest
from attacker import Attacker, Vouched
from nodes import NodeProcess, sees

from meshllm.errors import MeshllmError
from meshllm.mesh.messages import Exchange

pytestmark = pytest.mark.timeout(120)

IDENTITIES = 32
PADDING = 26 * 1024
ATTACK_S = 15.0


def test_a_member_resigning_its_identities_is_cooled(pair: tuple[NodeProcess, NodeProcess]) -> None:
    a, b = pair
    token = a.ready["invite"]

    async def attack() -> tuple[int, float | None]:
        mallory = Attacker(token)
        await mallory.start()
        conn = await mallory.connect(a.mesh_addr)
        identities = [Vouched(mallory, token, f"sybil{i}") for i in range(IDENTITIES)]
        start, sent = time.monotonic(), 0
        cooled_after = None
        while time.monotonic() - start < ATTACK_S:
            records = [v.record(padding=PADDING) for v in identities]
            try:
                for i in range(0, len(records), 8):
                    await mallory.send_gossip(conn, Exchange(records[i:i + 8]))
                    sent += len(records[i:i + 8])
            except MeshllmError:
                pass  # cut off: what being cooled looks like from here
            if any(e["type"] == "peer_cooled" and e.get("node_id") == mallory.node_id for e in a.events):
                cooled_after = time.monotonic() - start
                break
            await asyncio.sleep(1.0)
        await mallory.stop()
        return sent, cooled_after

    sent, cooled_after = asyncio.run(attack())
    print(f"records sent: {sent}; mallory cooled after {cooled_after} s")
    assert cooled_after is not None and cooled_after < 10.0, f"not cooled within 10 s (sent {sent} records)"
    assert sees(a, b.node_id, ("alive",)), "the honest member suffered"
