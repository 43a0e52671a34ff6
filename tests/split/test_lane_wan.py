"""Lanes over a long link (the WAN emulator at 400 ms RTT): probes wait for the round trip.

A fixed 250 ms probe deadline would call every lane to a peer that far away dead, replace it on every
reuse, and fail any request whose liveness check pinged it.
"""

from __future__ import annotations

import asyncio

from net.net_helpers import endpoint, until
from wan import LinkProfile, WanEmulator

from meshllm.split import StageServer
from meshllm.split.lanes import PROBE_TIMEOUT, probe_timeout
from meshllm.wire.addr import parse_addr


def test_a_lane_to_a_distant_peer_is_reused() -> None:
    async def main() -> None:
        with WanEmulator(LinkProfile.rtt(400)) as wan:
            a, b = wan.add_node("a"), wan.add_node("b")
            # the transport's probes count a ping unanswered when the next is due: space them wider than the RTT
            ea = await endpoint(port=a.real_port, probe_interval=0.6)
            eb = await endpoint(port=b.real_port, probe_interval=0.6)
            servers = [StageServer(ea), StageServer(eb)]
            try:
                # the mesh already holds a connection to every peer; a lane's own dial has 1 s, two round trips
                # at this distance, which a loaded host can miss
                await ea.connect(parse_addr(b.front_addr), eb.node_id, timeout=10)
                first = await servers[0].pool.get(eb.node_id, b.front_addr)
                await until(lambda: ea.peers[eb.node_id].rtt_ms is not None, timeout=5)
                assert probe_timeout(ea, eb.node_id) > PROBE_TIMEOUT + 0.35
                again = await servers[0].pool.get(eb.node_id, b.front_addr)
                assert again is first and first.closed is None
                pong = await first.probe(probe_timeout(ea, eb.node_id))
                assert pong is not None
            finally:
                for server in servers:
                    server.close()
                await ea.close()
                await eb.close()

    asyncio.run(main())
