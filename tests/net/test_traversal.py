"""Relayed connections and the punch upgrade between real endpoints on 127.0.0.1.

Loopback has no NAT, so the punch always succeeds here; tests/netns covers real NATs.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest
from net_helpers import Msg, endpoint, until

from meshllm.errors import MeshllmError
from meshllm.mesh.traversal import Traversal, parse_relay_entry, relay_entry
from meshllm.net import Endpoint, PeerConnection, PeerEventKind, Stream
from meshllm.net.relay import RelayLimits

pytestmark = pytest.mark.timeout(30)


async def echo(stream: Stream, _peer: PeerConnection) -> None:
    while (msg := await stream.recv(Msg)) is not None:
        await stream.send(msg)


async def roundtrip(conn: PeerConnection, text: str) -> str:
    stream = await conn.open_stream("echo")
    await stream.send(Msg(text))
    reply = await stream.recv(Msg, timeout=3.0)
    stream.close()
    assert reply is not None
    return reply.text


async def trio(limits: RelayLimits | None = None) -> tuple[list[Endpoint], list[Traversal], list[Any]]:
    eps = [await endpoint(probe_interval=0.05) for _ in range(3)]
    events: list[Any] = []
    travs = [Traversal(ep, "on" if i == 0 else "off", False, lambda *a, **k: events.append((a, k)), limits)
             for i, ep in enumerate(eps)]
    for ep in eps[1:]:
        ep.on_stream("echo", echo)
    relay, a, _ = eps
    assert await travs[2].reserve(relay.node_id, relay.local_addr)
    await a.connect(relay.local_addr, expected_node_id=relay.node_id)
    return eps, travs, events


def test_relay_entries_round_trip() -> None:
    text = relay_entry("ab" * 16, ("198.18.0.10", 9338))
    assert parse_relay_entry(text) == ("ab" * 16, ("198.18.0.10", 9338))


def test_relayed_connection_then_punched_upgrade() -> None:
    async def main() -> None:
        (relay, a, b), (_, ta, tb), _ = await trio()
        try:
            assert tb.relay_entries() == [relay_entry(relay.node_id, relay.local_addr)]
            conn = await ta.dial_via(relay.node_id, relay.local_addr, b.node_id, timeout=3.0)
            assert conn.path == "relayed" and conn.node_id == b.node_id
            assert await roundtrip(conn, "via relay") == "via relay"
            await until(lambda: b.peers.get(a.node_id) is not None)
            assert b.peers[a.node_id].path == "relayed"
            upgrades: list[str] = []
            a.on_peer_event(lambda e: upgrades.append(e.node_id) if e.kind is PeerEventKind.UPGRADED else None)
            loop = asyncio.get_running_loop()
            end = loop.time() + 10.0
            while not (a.peers[b.node_id].path == "punched" and b.peers[a.node_id].path == "punched"):
                assert loop.time() < end, "no punched path within 10 s"
                ta.tick(time.time(), [])  # the service's loop does this; retries follow the backoff
                await asyncio.sleep(0.05)
            assert upgrades == [b.node_id]
            assert await roundtrip(a.peers[b.node_id], "direct") == "direct"
            await until(lambda: conn.state == "closed", 20.0)  # the relayed one is retired
            assert a.peers[b.node_id].state == "alive"
        finally:
            for ep in (relay, a, b):
                await ep.close()

    asyncio.run(main())


def test_circuit_byte_limit_closes_the_relayed_connection() -> None:
    async def main() -> None:
        (relay, a, b), (_, ta, _), _ = await trio(RelayLimits(circuit_bytes=20_000))
        try:
            conn = await ta.dial_via(relay.node_id, relay.local_addr, b.node_id, timeout=3.0)
            with pytest.raises(MeshllmError):
                for _ in range(50):
                    await roundtrip(conn, "x" * 2000)
            await until(lambda: conn.state == "closed", 5.0)
        finally:
            for ep in (relay, a, b):
                await ep.close()

    asyncio.run(main())


def test_relay_refuses_targets_without_reservation_and_non_relays() -> None:
    async def main() -> None:
        (relay, a, b), (_, ta, tb), _ = await trio()
        try:
            with pytest.raises(Exception, match="no reservation"):
                await tb.dial_via(relay.node_id, relay.local_addr, a.node_id, timeout=3.0)
            # b does not relay (mode off): a reservation there is refused
            assert not await ta.reserve(b.node_id, b.local_addr)
            await asyncio.sleep(0)
        finally:
            for ep in (relay, a, b):
                await ep.close()

    asyncio.run(main())
