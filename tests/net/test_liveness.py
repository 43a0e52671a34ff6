"""Probes against live peers: RTT, a killed peer becoming suspect, reconnecting after a restart."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from pathlib import Path

from nacl.signing import SigningKey
from net_helpers import endpoint, until

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


def test_killed_peer_becomes_suspect_within_a_second() -> None:
    async def main() -> None:
        seed = os.urandom(32)
        proc = await asyncio.create_subprocess_exec(
            sys.executable, str(PEER), seed.hex(), stdout=asyncio.subprocess.PIPE
        )
        try:
            port = int((await asyncio.wait_for(proc.stdout.readline(), 10)).decode())  # type: ignore[union-attr]
            a = await endpoint()
            events: list = []
            a.on_peer_event(events.append)
            peer = await a.connect(("127.0.0.1", port), expected_node_id=node_id(bytes(SigningKey(seed).verify_key)))
            await until(lambda: peer.rtt_ms is not None, timeout=1.0)
            proc.send_signal(signal.SIGKILL)
            loop = asyncio.get_running_loop()
            killed_at = loop.time()
            await until(lambda: any(e.kind is PeerEventKind.SUSPECT for e in events), timeout=2.0)
            assert loop.time() - killed_at < 1.2
            assert peer.state == "suspect"
            await a.close()
        finally:
            if proc.returncode is None:
                proc.kill()
            await proc.wait()

    asyncio.run(main())


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
