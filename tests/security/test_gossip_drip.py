"""A stream that trickles its frame in a byte at a time is reset: deadlines bound whole frames.

Finding: a gossip stream dripping 1 byte/s was never reset, because the 2 s read deadline restarted
on every wake-up. Deadlines now bound the whole frame, and a peer that keeps trying is cooled down.
"""

from __future__ import annotations

import asyncio

import pytest
from attacker import Attacker, drip
from nodes import NodeProcess, wait_until

from meshllm.mesh.service import GOSSIP_STREAM

pytestmark = pytest.mark.timeout(120)


def test_a_dripping_gossip_stream_is_reset_and_its_peer_cooled_down(pair: tuple[NodeProcess, NodeProcess]) -> None:
    a, _ = pair

    async def attack() -> list[float | None]:
        mallory = Attacker(a.ready["invite"])
        await mallory.start()
        conn = await mallory.connect(a.mesh_addr)
        # four at once: each must be reset at the frame deadline, and together they earn the strikes
        streams = [await conn.open_stream(GOSSIP_STREAM) for _ in range(4)]
        resets = await asyncio.gather(*(drip(stream, 12.0) for stream in streams))
        await mallory.stop()
        return resets

    resets = asyncio.run(attack())
    print(f"dripping streams reset after {[None if r is None else round(r, 1) for r in resets]} s")
    assert resets[0] is not None and resets[0] < 8.0, "a 1 byte/s drip held a gossip stream open"
    assert all(r is not None for r in resets), "every dripping stream is reset"
    wait_until(lambda: any(e["type"] == "peer_cooled" for e in a.events), 10.0)
