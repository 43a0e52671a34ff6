"""Endpoints on real UDP sockets: identity, admission, one connection per pair, close."""

from __future__ import annotations

import asyncio
import socket

import pytest
from nacl.signing import SigningKey
from net_helpers import Msg, endpoint, until
from wan import LinkProfile, WanEmulator

from meshllm.errors import Untrusted
from meshllm.identity.ids import node_id as node_id_of
from meshllm.net import AdmissionRefused, ConnectError, ConnectTimeout, PeerEventKind, PeerMismatch
from meshllm.net.connection import PeerConnection
from meshllm.net.endpoint import DIAL_RACE_S
from meshllm.net.events import PeerEvent
from meshllm.net.messages import StreamOpen
from meshllm.wire.addr import format_addr, parse_addr
from meshllm.wire.frames import encode_frame


def test_handshake_proves_both_ids_and_exchanges_proofs_and_addresses() -> None:
    async def main() -> None:
        seen: dict[str, tuple[str, bytes]] = {}
        a = await endpoint(admit=lambda n, p, d: seen.__setitem__("a", (n, p)), proof=b"proof-a")
        b = await endpoint(admit=lambda n, p, d: seen.__setitem__("b", (n, p)), proof=b"proof-b")
        peer = await a.connect(b.local_addr)  # bootstrap: id learned from the certificate
        assert peer.node_id == b.node_id and peer.admitted
        await until(lambda: a.node_id in b.peers)
        assert seen == {"a": (b.node_id, b"proof-b"), "b": (a.node_id, b"proof-a")}
        assert peer.observed_addr == a.local_addr and b.peers[a.node_id].observed_addr == b.local_addr
        assert a.observed_addrs == {a.local_addr}
        assert await a.connect(b.local_addr, expected_node_id=b.node_id) is peer  # reused
        await b.close()
        await until(lambda: not a.peers)
        assert a.observed_addrs == set()  # (kept between changes of the peers: not a stale copy)
        await a.close()

    asyncio.run(main())


def test_dialer_expecting_another_node_gets_peer_mismatch() -> None:
    async def main() -> None:
        a, b = await endpoint(), await endpoint()
        other = await endpoint()
        with pytest.raises(PeerMismatch, match="expected node"):
            await a.connect(b.local_addr, expected_node_id=other.node_id)
        assert not a.peers and not b.peers
        for e in (a, b, other):
            await e.close()

    asyncio.run(main())


def test_refused_admission_is_typed_and_early_streams_never_reach_handlers(monkeypatch, caplog) -> None:  # type: ignore[no-untyped-def]
    def refuse(peer: str, proof: bytes, dialer: bool) -> None:
        raise Untrusted("not in the allowlist")

    handled: list[str] = []
    original = PeerConnection._on_handshake

    def sneak_a_stream_in_first(self: PeerConnection, event) -> None:  # type: ignore[no-untyped-def]
        original(self, event)
        if self.dialer:  # a misbehaving dialer opens a stream right after its Hello, before admission
            payload = encode_frame(StreamOpen("echo")) + encode_frame(Msg("hi"))
            asyncio.get_running_loop().call_soon(self.quic.send_stream_data, 4, payload)

    async def main() -> None:
        async def handler(stream, peer) -> None:  # type: ignore[no-untyped-def]
            handled.append(peer.node_id)

        b = await endpoint(admit=refuse)
        b.on_stream("echo", handler)
        a = await endpoint()
        with pytest.raises(AdmissionRefused, match="not in the allowlist") as info:
            await a.connect(b.local_addr, expected_node_id=b.node_id)
        assert info.value.reason == "not in the allowlist"
        await until(lambda: "resetting stream #4" in caplog.text)  # the sneaked stream was handled (refused)
        assert handled == [] and not b.peers
        assert "resetting stream #4" in caplog.text and "not admitted" in caplog.text
        await a.close()
        await b.close()

    monkeypatch.setattr(PeerConnection, "_on_handshake", sneak_a_stream_in_first)
    asyncio.run(main())


def test_what_a_dialer_sends_at_once_reaches_the_acceptor_once_it_holds_the_connection() -> None:
    """The dialer is admitted on the acceptor's Welcome and may speak before its Confirm arrives. Its first
    datagram and stream reach the acceptor's handlers only once the acceptor holds the connection, so an
    answer addressed to the dialer's node id leaves (a joiner's first gossip summary was answered into a
    connection the acceptor did not hold yet, and the answer dropped)."""
    async def main() -> None:
        seen: list[tuple[str, bool]] = []
        b = await endpoint()

        def on_datagram(conn: PeerConnection, data: bytes) -> None:
            seen.append((data.decode(), b.peers.get(conn.node_id or "") is conn))

        async def handler(stream, conn) -> None:  # type: ignore[no-untyped-def]
            seen.append(("stream", b.peers.get(conn.node_id) is conn))

        async def speak(conn: PeerConnection) -> None:
            stream = await conn.open_stream("echo")
            await stream.send(Msg("hi"), timeout=1.0)

        def on_connected(event: PeerEvent) -> None:  # as a joiner greets: in the step that admitted it
            if event.kind is PeerEventKind.CONNECTED:
                assert a.peers[event.node_id].send_datagram(b"first")
                tasks.add(asyncio.ensure_future(speak(a.peers[event.node_id])))

        tasks: set[asyncio.Task[None]] = set()
        b.on_datagram = on_datagram
        b.on_stream("echo", handler)
        a = await endpoint()
        a.on_peer_event(on_connected)
        for _ in range(5):  # each round is a fresh connection
            conn = await a.connect(b.local_addr, expected_node_id=b.node_id)
            await until(lambda: len(seen) >= 2)
            assert sorted(seen) == [("first", True), ("stream", True)]
            seen.clear()
            conn.close("next round")
            await until(lambda: not b.peers)
        await a.close()
        await b.close()

    asyncio.run(main())


def test_dialer_refuses_the_acceptor_proof() -> None:
    def refuse(peer: str, proof: bytes, dialer: bool) -> None:
        raise Untrusted(f"bad proof {proof!r}")

    async def main() -> None:
        a, b = await endpoint(admit=refuse), await endpoint(proof=b"forged")
        closed = asyncio.Event()
        b.on_peer_event(lambda e: closed.set())
        with pytest.raises(AdmissionRefused, match="forged"):
            await a.connect(b.local_addr)
        await until(lambda: not b.peers)
        await a.close()
        await b.close()

    asyncio.run(main())


def test_clean_close_is_seen_by_the_peer_promptly() -> None:
    async def main() -> None:
        a, b = await endpoint(), await endpoint()
        events: list = []
        b.on_peer_event(events.append)
        await a.connect(b.local_addr)
        await until(lambda: any(e.kind is PeerEventKind.CONNECTED for e in events))
        loop = asyncio.get_running_loop()
        start = loop.time()
        a.peers[b.node_id].close("going away for maintenance")
        await until(lambda: any(e.kind is PeerEventKind.CLOSED for e in events), timeout=1.0)
        assert loop.time() - start < 0.5
        closed = next(e for e in events if e.kind is PeerEventKind.CLOSED)
        assert closed.node_id == a.node_id and closed.reason == "going away for maintenance"
        assert not a.peers and not b.peers
        await a.close()
        await b.close()

    asyncio.run(main())


def test_simultaneous_dials_converge_on_one_connection() -> None:
    async def main() -> None:
        a, b = await endpoint(), await endpoint()
        pa, pb = await asyncio.gather(a.connect(b.local_addr), b.connect(a.local_addr))
        assert pa.node_id == b.node_id and pb.node_id == a.node_id
        # converged: both ends keep the same connection (one dialed it, the other accepted it)
        await until(lambda: len(a.peers) == len(b.peers) == 1 and b.node_id in a.peers and a.node_id in b.peers
                    and a.peers[b.node_id].dialer != b.peers[a.node_id].dialer)
        assert len(a.peers) == 1 and len(b.peers) == 1
        kept_a, kept_b = a.peers[b.node_id], b.peers[a.node_id]
        assert kept_a.state == "alive" and kept_b.state == "alive"
        assert kept_a.dialer != kept_b.dialer  # the same connection, seen from both ends
        stream = await kept_a.open_stream("x")
        assert stream is not None
        await a.close()
        await b.close()

    asyncio.run(main())


def test_a_restarted_peer_replaces_the_dead_connection_whoever_dialed_it() -> None:
    """A peer killed without a word and started again (same key, new port) dials us while we still hold
    the connection to its old process. The simultaneous-dial rule (keep the one the smaller id dialed) is
    for two live connections; here it kept the dead one and refused the live one, so the restarted node
    could not reach us until the dead one timed out."""
    async def main() -> None:
        keys = sorted((SigningKey.generate() for _ in range(2)), key=lambda k: node_id_of(bytes(k.verify_key)))
        survivor, peer = await endpoint(keys[0]), await endpoint(keys[1])  # the survivor's id is the smaller
        old = await survivor.connect(peer.local_addr)
        assert old.dialer
        peer._transport.close()  # kill -9: no CONNECTION_CLOSE leaves
        await peer.close()
        await asyncio.sleep(DIAL_RACE_S + 0.2)
        restarted = await endpoint(keys[1])
        conn = await restarted.connect(survivor.local_addr)
        await until(lambda: survivor.peers.get(peer.node_id) is not old)
        kept = survivor.peers[peer.node_id]
        assert not kept.dialer and kept.state == "alive" and old.state == "closed"
        await asyncio.sleep(0.3)
        assert conn.state == "alive" and restarted.peers[survivor.node_id] is conn
        stream = await conn.open_stream("x")
        assert stream is not None
        await restarted.close()
        await survivor.close()

    asyncio.run(main())


def test_a_passive_dialer_is_marked_and_only_answered_not_probed() -> None:
    """``Hello.passive``: the acceptor marks the connection passive and sends no probes of its own on it,
    yet answers the client's, so the client measures its RTT."""
    async def main() -> None:
        member = await endpoint(probe_interval=0.05)
        client = await endpoint(passive=True, probe_interval=0.05)
        peer = await client.connect(member.local_addr)
        await until(lambda: client.node_id in member.peers)
        inbound = member.peers[client.node_id]
        assert inbound.passive and not peer.passive
        await until(lambda: peer.rtt_ms is not None)
        await asyncio.sleep(0.3)
        assert inbound.probes is not None and inbound.probes.rtt_ms is None  # the member never pinged
        await client.close()
        await member.close()

    asyncio.run(main())


def test_connect_node_dials_each_gossiped_address_once_in_order() -> None:
    """A record lists its address both as its own and as observed by peers: a dead node must cost
    one dial deadline, not one per copy (a failover took two deadlines when it did)."""
    async def main() -> None:
        a, b = await endpoint(), await endpoint()
        dead = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        dead.bind(("127.0.0.1", 0))  # bound and silent: a node that stopped answering
        silent = format_addr(dead.getsockname())
        with pytest.raises(ConnectError) as caught:
            await a.connect_node(b.node_id, [silent, silent], timeout=0.3)
        assert str(caught.value).count("no admitted connection") == 1, caught.value
        live = format_addr(b.local_addr)
        conn = await a.connect_node(b.node_id, [silent, live], timeout=0.3)  # the next address answers
        assert conn.node_id == b.node_id
        assert await a.connect_node(b.node_id, [], timeout=0.3) is conn  # an open connection is reused
        dead.close()
        await a.close()
        await b.close()

    asyncio.run(main())


def test_a_dial_outlives_its_callers_timeout_and_the_next_call_joins_it() -> None:
    """On 50 nodes sharing two cores a handshake and admission took over 3 s: each dial was closed at its
    caller's 3 s and the next one started from scratch, and a member could not reach a live peer for 17 s.
    A dial now goes on after its caller gave up, and the next call for that address joins it."""
    async def main() -> None:
        with WanEmulator(LinkProfile.rtt(400)) as wan:
            far = wan.add_node("b")
            a, b = await endpoint(), await endpoint(port=far.real_port)
            addr = parse_addr(far.front_addr)
            with pytest.raises(ConnectTimeout):
                await a.connect(addr, b.node_id, timeout=0.3)  # a handshake and admission take 3 round trips
            dial = a._dialing[addr]
            assert dial.close_reason is None  # still going
            assert await a.connect(addr, b.node_id, timeout=5) is dial
            assert not a._dialing
            await a.close()
            await b.close()

    asyncio.run(main())


def test_a_peers_close_ends_the_connection_at_once_not_after_draining() -> None:
    """aioquic reports a peer's CONNECTION_CLOSE only when its draining period (3 PTOs) ends, tens of
    seconds on a loaded host: meanwhile the closed connection looked open, and the failure detector
    probing into it declared the live peer down. The close now ends it when it arrives."""
    async def main() -> None:
        with WanEmulator(LinkProfile.rtt(400)) as wan:  # a PTO of over 400 ms: over a second of draining
            far = wan.add_node("b")
            a, b = await endpoint(), await endpoint(port=far.real_port)
            ours = await a.connect(parse_addr(far.front_addr), b.node_id, timeout=10)
            events: list[PeerEvent] = []
            a.on_peer_event(events.append)
            await until(lambda: a.node_id in b.peers, timeout=5)
            b.peers[a.node_id].close("rotated out of the partial view")
            await until(lambda: ours.close_reason is not None, timeout=5)
            assert a._routes  # aioquic still drains it (its packets still go there): noticed before that ends
            assert ours.close_reason == "rotated out of the partial view"
            assert b.node_id not in a.peers
            assert [(e.kind, e.node_id) for e in events] == [(PeerEventKind.CLOSED, b.node_id)]
            await until(lambda: not a._routes, timeout=10)  # aioquic's draining still ends the routes
            await a.close()
            await b.close()

    asyncio.run(main())


def test_a_dial_nobody_answers_ends_at_the_admission_timeout() -> None:
    async def main() -> None:
        a = await endpoint(admission_timeout=0.5)
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as dead:
            dead.bind(("127.0.0.1", 0))  # bound and silent
            with pytest.raises(ConnectTimeout):
                await a.connect(dead.getsockname(), timeout=0.1)
            assert a._dialing  # retransmitting its Initial
            await until(lambda: not a._dialing and not a._routes, timeout=3.0)
        await a.close()

    asyncio.run(main())
