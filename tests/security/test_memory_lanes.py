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

from meshllm.net import PeerConnection
from meshllm.net.messages import ResetCode

pytestmark = pytest.mark.timeout(120)

STREAMS = 20
FRAME = FRAME_31M
ATTACK_S = 15.0
"""The longest the frames are watched; the watch ends sooner once A has stopped granting credit."""
STALLED_S = 3.0
"""How long A must have granted the attacker no connection credit (so no more of the frames can arrive)
before the watch ends: the peak of what A holds is then behind us."""


def credit(conn: PeerConnection) -> tuple[int, int]:
    """(bytes sent, bytes A allows) on the attacker's connection: aioquic's connection flow-control
    counters (private; a renamed attribute fails this test loudly, not silently)."""
    return conn.quic._remote_max_data_used, conn.quic._remote_max_data


def test_unfinished_lane_frames_are_bounded_and_released(pair: tuple[NodeProcess, NodeProcess]) -> None:
    a, _ = pair
    baseline = rss_mb(a.proc.pid)
    peak = baseline

    async def attack() -> None:
        nonlocal peak
        mallory = Attacker(a.ready["invite"])
        await mallory.start()
        try:
            conn = await mallory.connect(a.mesh_addr)
            streams = await unfinished_lane_frames(conn, STREAMS, FRAME)
            start = time.monotonic()
            last, stalled_since = credit(conn), start
            while (now := time.monotonic()) < start + ATTACK_S and now - stalled_since < STALLED_S:
                peak = max(peak, rss_mb(a.proc.pid))
                await asyncio.sleep(0.25)
                sent, allowed = credit(conn)
                if sent < allowed or (sent, allowed) != last:  # still sending, or A granted more
                    last, stalled_since = (sent, allowed), time.monotonic()
            print(f"A granted {last[1] >> 20} MiB in all; watched {time.monotonic() - start:.1f} s")
            print(f"A's RSS: baseline {baseline:.0f} MB, peak {peak:.0f} MB with {STREAMS} unfinished "
                  f"{FRAME >> 20} MiB frames")
            assert peak - baseline < 80, f"A grew by {peak - baseline:.0f} MB"
            for stream in streams:
                stream.reset(ResetCode.CANCELLED)
            # released because the streams were reset, while the attacker is still connected
            await asyncio.to_thread(wait_until, lambda: rss_mb(a.proc.pid) - baseline < 40, 10.0)
            print(f"A's RSS after the streams were reset: {rss_mb(a.proc.pid):.0f} MB")
        finally:
            await mallory.stop()

    asyncio.run(attack())
    assert a.proc.poll() is None
