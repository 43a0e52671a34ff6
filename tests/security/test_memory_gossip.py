"""A member that floods digests and never reads the answers cannot grow a node's memory.

Finding: four streams of empty digests from a peer that never read its responses grew the owner
from 266 MB to 1.1 GB in 30 s, still climbing: every digest was answered with a full exchange on a
fresh stream, queued without bound behind a peer that granted no credit.
"""

from __future__ import annotations

import asyncio
import time

import pytest
from attacker import Attacker, flood_digests, rss_mb
from nodes import NodeProcess, sees

pytestmark = pytest.mark.timeout(120)

ATTACK_S = 15.0


def test_digest_flood_from_a_non_reader_is_bounded_and_cooled_down(pair: tuple[NodeProcess, NodeProcess]) -> None:
    a, b = pair
    baseline = rss_mb(a.proc.pid)
    peak = baseline

    async def attack() -> None:
        nonlocal peak
        mallory = Attacker(a.ready["invite"], padding=56 * 1024, window=2048)
        await mallory.start()
        conn = await mallory.connect(a.mesh_addr)
        end = time.monotonic() + ATTACK_S

        async def watch() -> None:
            nonlocal peak
            while time.monotonic() < end:
                peak = max(peak, rss_mb(a.proc.pid))
                await asyncio.sleep(0.25)

        await asyncio.gather(flood_digests(mallory, conn, end), watch())
        await mallory.stop()

    asyncio.run(attack())
    growth = peak - baseline
    print(f"A's RSS: baseline {baseline:.0f} MB, peak {peak:.0f} MB during {ATTACK_S:.0f} s of digests")
    assert growth < 60, f"A grew by {growth:.0f} MB under a digest flood"
    assert a.proc.poll() is None
    assert any(e["type"] == "peer_cooled" for e in a.events), "the flooding member was never cooled down"
    assert sees(a, b.node_id, ("alive",)), "the honest member suffered"
