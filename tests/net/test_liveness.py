"""Probes against live peers: RTT, a killed peer becoming suspect, reconnecting after a restart."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from pathlib import Path

from nacl.signing import SigningKey
from net_helpers import Msg, endpoint, until

from meshllm.identity.ids import node_id
from meshllm.net import Backoff, PeerEventKind, dial_with_retry

PEER = Path(__file__).with_name("peer_proc.py")


def test_probe_rtt_appears_for_both_ends() -> None:
    async def main() -> None:
        a, b = await endpoint(), await endpoint()
        peer = await a.connect(b.local_addr)
        await until(lambda: peer.rtt_ms is not None and b.peers[a.node_id].rtt_ms is not None, timeout=1.0)
        assert 0 < peer.rtt_ms < 100  # type: ignore[operator]
        await a.close()
        await b.close()

    asyncio.run(main())


def seconds_to_suspect_a_killed_peer(patience: int) -> float:
    """Connect to a peer process, kill it (-9), and time our connection's SUSPECT with ``patience``."""
    async def main() -> float:
        seed = os.urandom(32)
        proc = await asyncio.create_subprocess_exec(
            sys.executable, str(PEER), seed.hex(), stdout=asyncio.subprocess.PIPE
        )
        try:
            port = int((await asyncio.wait_for(proc.stdout.readline(), 10)).decode())  # type: ignore[union-attr]
            a = await endpoint()
            a.patience = lambda node: patience
            events: list = []
            a.on_peer_event(events.append)
            peer = await a.connect(("127.0.0.1", port), expected_node_id=node_id(bytes(SigningKey(seed).verify_key)))
            await until(lambda: peer.rtt_ms is not None, timeout=1.0)
            proc.send_signal(signal.SIGKILL)
            loop = asyncio.get_running_loop()
            killed_at = loop.time()
            await until(lambda: any(e.kind is PeerEventKind.SUSPECT for e in events), timeout=2.0 * patience)
            assert peer.state == "suspect"
            await a.close()
            return loop.time() - killed_at
        finally:
            if proc.returncode is None:
                proc.kill()
            await proc.wait()

    return asyncio.run(main())


def test_killed_peer_becomes_suspect_within_a_second() -> None:
    assert seconds_to_suspect_a_killed_peer(1) < 1.2


def test_an_overloaded_node_gives_a_silent_peer_longer() -> None:
    """``Endpoint.patience`` (the failure detector's local-health stretch on a member) paces the probes:
    at 4, three missed pings take about 3 s, not 0.75 s."""
    assert seconds_to_suspect_a_killed_peer(4) > 2.0


def test_reconnect_after_the_peer_restarts() -> None:
    async def main() -> None:
        key = SigningKey.generate()
        a, b = await endpoint(), await endpoint(key)
        port = b.local_addr[1]
        first = await a.connect(b.local_addr)
        await b.close()
        await until(lambda: first.state == "closed", timeout=1.0)

        async def restart_later() -> None:
            await asyncio.sleep(0.3)
            nonlocal b
            b = await endpoint(key, port=port)

        restart = asyncio.create_task(restart_later())
        second = await dial_with_retry(
            a, ("127.0.0.1", port), expected_node_id=b.node_id, deadline=5.0, attempt_timeout=0.2,
            backoff=Backoff(initial=0.05, maximum=0.2),
        )
        await restart
        assert second is not first and second.admitted and second.node_id == first.node_id
        assert a.peers[second.node_id] is second
        await a.close()
        await b.close()

    asyncio.run(main())


def test_probes_pace_with_the_work_a_connection_carries() -> None:
    """Quiet (no stream, or only ``quiet_kinds`` ones): a ping every ``idle_probe_interval``. The first stream
    of work speeds both ends up to ``probe_interval`` at once, and they slow down again when it ends."""
    async def main() -> None:
        opts = {"probe_interval": 0.05, "idle_probe_interval": 5.0, "quiet_kinds": frozenset({"chatter"})}
        a, b = await endpoint(**opts), await endpoint(**opts)
        release = asyncio.Event()

        async def hold(stream, peer) -> None:  # type: ignore[no-untyped-def]
            await release.wait()

        for ep in (a, b):
            ep.on_stream("work", hold)
            ep.on_stream("chatter", hold)
        conn = await a.connect(b.local_addr)
        await until(lambda: a.node_id in b.peers)
        inbound = b.peers[a.node_id]
        assert conn.probes is not None and inbound.probes is not None
        await until(lambda: conn.probes.interval == inbound.probes.interval == 5.0)
        await until(lambda: conn.probes.rtt_ms is not None)  # type: ignore[union-attr]  # the first quiet ping left at once
        chatter = await conn.open_stream("chatter")
        chatter.send_nowait(Msg("gossip"))
        await asyncio.sleep(0.3)
        assert conn.probes.interval == inbound.probes.interval == 5.0  # a quiet kind is no work
        work = await conn.open_stream("work")
        work.send_nowait(Msg("a request"))
        await until(lambda: conn.probes.interval == inbound.probes.interval == 0.05, timeout=1.0)
        release.set()
        for stream in (chatter, work):
            stream.close()
        await until(lambda: conn.probes.interval == inbound.probes.interval == 5.0)
        assert conn.state == inbound.state == "alive"  # pings sent at the fast pace were not counted missed
        await a.close()
        await b.close()

    asyncio.run(main())


def test_other_datagrams_reach_the_endpoint_and_probes_do_not() -> None:
    """A connection's datagrams are the transport's probes (first byte 1 or 2) or the application's: those
    go to ``Endpoint.on_datagram``, from an admitted member only."""
    async def main() -> None:
        a, b = await endpoint(probe_interval=0.05), await endpoint(probe_interval=0.05)
        got: list[tuple[str, bytes]] = []
        b.on_datagram = lambda conn, data: got.append((conn.node_id, data))
        conn = await a.connect(b.local_addr)
        await until(lambda: conn.rtt_ms is not None)  # probes flowed both ways, none reached the handler
        assert conn.send_datagram(b"\x81\xa1x\x01")
        await until(lambda: got == [(a.node_id, b"\x81\xa1x\x01")])
        client = await endpoint(passive=True)
        passive = await client.connect(b.local_addr)
        passive.send_datagram(b"\x81\xa1y\x02")  # a passive client takes no part in what members say
        conn.send_datagram(b"\x81\xa1z\x03")
        await until(lambda: len(got) == 2)
        assert got[1] == (a.node_id, b"\x81\xa1z\x03")
        for ep in (a, b, client):
            await ep.close()

    asyncio.run(main())
