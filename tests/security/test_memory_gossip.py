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
"""The longest the flood runs; the watch ends sooner once A has cooled the flooder down."""
AFTER_COOL_S = 3.0
"""How long A's memory is still watched after the cool-down (what A queued is then behind us)."""


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
        flood = asyncio.create_task(flood_digests(mallory, conn, end))
        cooled_at: float | None = None
        while (now := time.monotonic()) < end and (cooled_at is None or now - cooled_at < AFTER_COOL_S):
            peak = max(peak, rss_mb(a.proc.pid))
            if cooled_at is None and any(e["type"] == "peer_cooled" and e["node_id"] == mallory.node_id
                                         for e in a.events):
                cooled_at = now
            await asyncio.sleep(0.25)
        flood.cancel()
        await asyncio.gather(flood, return_exceptions=True)
        await mallory.stop()

    asyncio.run(attack())
    growth = peak - baseline
    print(f"A's RSS: baseline {baseline:.0f} MB, peak {peak:.0f} MB during the digest flood")
    assert growth < 60, f"A grew by {growth:.0f} MB under a digest flood"
    assert a.proc.poll() is None
    assert any(e["type"] == "peer_cooled" for e in a.events), "the flooding member was never cooled down"
    assert sees(a, b.node_id, ("alive",)), "the honest member suffered"
