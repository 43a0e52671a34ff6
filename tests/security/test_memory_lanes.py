"""Unfinished large frames on many streams cannot grow a node, and what they held is released.

Finding: twenty stage-lane streams, each sending an unfinished 31 MiB frame, grew the owner from
107 to 751 MB; nothing was released after the streams were reset. A partial frame counted as
consumed, so its sender got credit for all of it, on every stream at once.
"""

from __future__ import annotations

import asyncio
import time

import pytest
from attacker import FRAME_31M, Attacker, rss_mb, unfinished_lane_frames
from nodes import NodeProcess, wait_until

from meshllm.net.messages import ResetCode

pytestmark = pytest.mark.timeout(120)

STREAMS = 20
FRAME = FRAME_31M
ATTACK_S = 15.0


def test_unfinished_lane_frames_are_bounded_and_released(pair: tuple[NodeProcess, NodeProcess]) -> None:
    a, _ = pair
    baseline = rss_mb(a.proc.pid)
    peak = baseline

    async def attack() -> None:
        nonlocal peak
        mallory = Attacker(a.ready["invite"])
        await mallory.start()
        conn = await mallory.connect(a.mesh_addr)
        streams = await unfinished_lane_frames(conn, STREAMS, FRAME)
        end = time.monotonic() + ATTACK_S
        while time.monotonic() < end:
            peak = max(peak, rss_mb(a.proc.pid))
            await asyncio.sleep(0.25)
        for stream in streams:
            stream.reset(ResetCode.CANCELLED)
        await asyncio.sleep(3.0)
        await mallory.stop()

    asyncio.run(attack())
    print(f"A's RSS: baseline {baseline:.0f} MB, peak {peak:.0f} MB with {STREAMS} unfinished {FRAME >> 20} MiB frames")
    assert peak - baseline < 80, f"A grew by {peak - baseline:.0f} MB"
    wait_until(lambda: rss_mb(a.proc.pid) - baseline < 40, 10.0)
    print(f"A's RSS after the streams were reset: {rss_mb(a.proc.pid):.0f} MB")
    assert a.proc.poll() is None
