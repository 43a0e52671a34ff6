"""NAT traversal driver: serve as a relay, hold reservations, dial through relays, punch.

The decisions live in sans-IO cores (:mod:`meshllm.net.relay` books reservations and circuits,
:mod:`meshllm.net.nat` classifies reachability and schedules punches); this module moves their
messages over ``relay`` and ``punch`` streams and plugs relay circuits into the endpoint as
virtual paths (:class:`~meshllm.net.circuit.RelayChannel`). :class:`~meshllm.mesh.service.MeshService`
owns one :class:`Traversal` and calls it from its loop. docs/nat.md describes the whole design.

A relay entry in a record is ``<relay node id>@<host:port>``: the id pins the relay's identity
(its certificate is checked), the address lets a member that lost track of the relay redial it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import time
from collections.abc import Callable
from typing import Any

from meshllm.errors import DecodeError, MeshllmError
from meshllm.net.backoff import Backoff
from meshllm.net.circuit import RelayChannel, virtual_addr
from meshllm.net.connection import PeerConnection
from meshllm.net.endpoint import Endpoint
from meshllm.net.errors import ConnectError, StreamClosed
from meshllm.net.messages import Addr
from meshllm.net.nat import (
    MAX_PUNCH_ADDR_LEN,
    MAX_PUNCH_ADDRS,
    PUNCH_STREAM,
    PunchConnect,
    PunchMessage,
    PunchSchedule,
    PunchSync,
    Reachability,
    RelayMode,
    is_ip,
    reachability,
    serves_relay,
    sync_delay,
)
from meshllm.net.relay import (
    RELAY_STREAM,
    Accept,
    ConnectTo,
    Incoming,
    Refused,
    RelayBook,
    RelayLimits,
    RelayMessage,
    Reserve,
    Reserved,
)
from meshllm.net.streams import Stream
from meshllm.tasks import spawn
from meshllm.wire.addr import format_addr, parse_addr

log = logging.getLogger(__name__)

CONTROL_TIMEOUT_S = 3.0
PUNCH_DIAL_TIMEOUT_S = 3.0
PUNCH_LABEL_S = 10.0
"""How long after a punch attempt a direct connection with that peer still counts as punched."""
PUNCH_PACKET = b"\x00meshllm-punch"
"""What the responder sends to open its NAT (a zero first byte is no QUIC packet: receivers drop it)."""
PUNCH_PACKET_INTERVAL_S = 0.05
MAX_RESERVATIONS = 2
MAX_OBSERVED = 4

OnEvent = Callable[..., None]


def relay_entry(relay_id: str, addr: Addr) -> str:
    """The record form of a relay: ``<node id>@<host:port>``."""
    return f"{relay_id}@{format_addr(addr)}"


def parse_relay_entry(text: str) -> tuple[str, Addr]:
    """``(relay node id, address)`` from a record's relay entry; DecodeError if malformed."""
    relay_id, sep, addr = text.partition("@")
    if not sep or not relay_id:
        raise DecodeError(f"{text!r} is not NODE_ID@HOST:PORT")
    return relay_id, parse_addr(addr)


def is_local_host(host: str) -> bool:
    """True when ``host`` is an address of one of our interfaces (binding to it succeeds)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as sock:
        try:
            sock.bind((host, 0))
        except OSError:
            return False
    return True


class Traversal:
    """One node's relay service, reservations, relayed dials and punch attempts."""

    def __init__(
        self, endpoint: Endpoint, mode: RelayMode, announced: bool, on_event: OnEvent,
        limits: RelayLimits | None = None,
    ) -> None:
        self.endpoint = endpoint
        self.mode = mode
        self.announced = announced
        self.book = RelayBook(limits or RelayLimits())
        self.schedule = PunchSchedule()
        self.reservations: dict[str, tuple[Addr, float]] = {}
        """relay node id -> (its address, when to refresh) for reservations we hold."""
        self._on_event = on_event
        self._reserving = False
        self._reserve_backoff = Backoff(1.0, 2.0, 30.0)
        self._reserve_at = 0.0
        """While no relay grants us a slot, attempts back off (1 s doubling to 30 s)."""
        self._refused: dict[str, float] = {}
        """Relay candidates that refused us, and until when we leave them alone."""
        self._tasks: set[asyncio.Task[Any]] = set()
        self._local_cache: dict[str, bool] = {}
        self._relayed: tuple[int, list[str]] = (-1, [])
        """The relayed connections we dialed (punch candidates), as of ``endpoint.peers_version``."""
        self._mapping: set[str] = set()
        """Peers we are sending NAT-opening junk to right now (one sender per peer at a time)."""
        endpoint.on_stream(RELAY_STREAM, self._serve_relay)
        endpoint.on_stream(PUNCH_STREAM, self._serve_punch)

    # -- queries ----------------------------------------------------------------------------------

    @property
    def reachability(self) -> Reachability:
        return reachability(self.endpoint.local_addr[1], self.endpoint.observed_addrs, self._is_local,
                            self.announced)

    @property
    def relaying(self) -> bool:
        """Whether we accept reservations now."""
        return serves_relay(self.mode, self.reachability)

    def observed(self) -> list[str]:
        """Our public addresses as peers report them (for our record), at most a few."""
        addrs = sorted(format_addr(a) for a in self.endpoint.observed_addrs if is_ip(a[0]))
        return addrs[:MAX_OBSERVED]

    def relay_entries(self) -> list[str]:
        """Relays we hold a reservation at, in record form."""
        return sorted(relay_entry(rid, addr) for rid, (addr, _) in self.reservations.items())

    def _is_local(self, host: str) -> bool:
        if host not in self._local_cache:
            self._local_cache[host] = is_local_host(host)
        return self._local_cache[host]

    # -- periodic work (called from the service loop) ---------------------------------------------

    def tick(self, now: float, bootstrap: list[str]) -> None:
        """Keep reservations while we are behind a NAT, and start due punch attempts."""
        for rid in [r for r in self.reservations if self._relay_conn(r) is None]:
            del self.reservations[rid]
        if self.reachability is Reachability.PRIVATE and not self._reserving:
            due = any(refresh <= now for _, refresh in self.reservations.values())
            if due or (not self.reservations and now >= self._reserve_at):
                self._reserving = True
                spawn(self._tasks, self._keep_reservations(now, bootstrap))
        if self._relayed[0] != self.endpoint.peers_version:
            self._relayed = self.endpoint.peers_version, [
                pid for pid, conn in self.endpoint.peers.items() if conn.path == "relayed" and conn.dialer]
        for peer in self.schedule.due(self._relayed[1], now):
            conn = self.endpoint.peers.get(peer)
            if conn is not None:
                self.schedule.started(peer)
                spawn(self._tasks, self._punch(conn))

    def peer_closed(self, peer: str) -> None:
        """A peer's connection ended: its reservation at us (if any) goes with it."""
        self.book.release(peer)
        self.reservations.pop(peer, None)

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()

    # -- reservations (client side) -----------------------------------------------------------------

    async def _keep_reservations(self, now: float, bootstrap: list[str]) -> None:
        try:
            for rid, (addr, refresh) in list(self.reservations.items()):
                if refresh <= now and not await self.reserve(rid, addr):
                    del self.reservations[rid]
            if len(self.reservations) >= MAX_RESERVATIONS:
                return
            candidates: list[tuple[str | None, Addr]] = [
                (pid, conn.remote_addr) for pid, conn in self.endpoint.peers.items()
                if conn.path != "relayed" and pid not in self.reservations
            ]
            if not candidates:
                candidates = [(None, parse_addr(text)) for text in bootstrap]
            for rid, addr in candidates:
                if len(self.reservations) >= MAX_RESERVATIONS:
                    break
                if rid is not None and self._refused.get(rid, 0.0) > time.time():
                    continue
                await self.reserve(rid, addr)
        finally:
            self._reserving = False
            if self.reservations:
                self._reserve_backoff.reset()
            else:
                self._reserve_at = time.time() + self._reserve_backoff.next_delay()

    async def reserve(self, relay_id: str | None, addr: Addr) -> bool:
        """Reserve a slot at the relay at ``addr`` (its id pinned if known); True when granted."""
        try:
            conn = await self.endpoint.connect(addr, expected_node_id=relay_id, timeout=CONTROL_TIMEOUT_S)
            stream = await conn.open_stream(RELAY_STREAM)
            await stream.send(Reserve(), timeout=CONTROL_TIMEOUT_S)
            reply = await stream.recv(RelayMessage, timeout=CONTROL_TIMEOUT_S)
            stream.close()
        except MeshllmError as exc:
            log.debug("reservation at %s failed: %s", format_addr(addr), exc)
            return False
        rid = conn.node_id or ""
        if not isinstance(reply, Reserved):
            self._refused[rid] = time.time() + 30.0
            return False
        fresh = rid not in self.reservations
        self.reservations[rid] = (conn.remote_addr, time.time() + reply.ttl_s / 2)
        if fresh:
            self._on_event("relay_reserved", relay=rid, addr=format_addr(conn.remote_addr))
        return True

    def _relay_conn(self, relay_id: str) -> PeerConnection | None:
        conn = self.endpoint.peers.get(relay_id)
        return conn if conn is not None and conn.path != "relayed" else None

    # -- dialing through a relay ------------------------------------------------------------------

    async def dial_via(self, relay_id: str, relay_addr: Addr, target: str, timeout: float) -> PeerConnection:
        """An end-to-end connection to ``target`` whose packets travel through ``relay_id``."""
        if relay_id == self.endpoint.node_id:
            raise ConnectError("we are the relay named for this peer")
        relay = self._relay_conn(relay_id) or await self.endpoint.connect(
            relay_addr, expected_node_id=relay_id, timeout=timeout)
        stream = await relay.open_stream(RELAY_STREAM)
        await stream.send(ConnectTo(target), timeout=CONTROL_TIMEOUT_S)
        reply = await stream.recv(RelayMessage, timeout=CONTROL_TIMEOUT_S)
        if not isinstance(reply, Accept):
            stream.reset()
            reason = reply.reason if isinstance(reply, Refused) else "no answer"
            raise ConnectError(f"relay {relay_id[:8]} refused a circuit to {target[:8]}: {reason}")
        channel = self._channel(stream, relay_id)
        try:
            return await self.endpoint.connect(channel.addr, expected_node_id=target, timeout=timeout)
        except MeshllmError:
            channel.close("relayed dial failed")
            raise

    def _channel(self, stream: Stream, relay_id: str) -> RelayChannel:
        channel = RelayChannel(stream, virtual_addr(relay_id), self.endpoint.datagram_received, self.endpoint.detach)
        self.endpoint.attach(channel)
        return channel

    # -- the relay stream handler (relay and target sides) --------------------------------------

    async def _serve_relay(self, stream: Stream, conn: PeerConnection) -> None:
        message = await stream.recv(RelayMessage, timeout=CONTROL_TIMEOUT_S)
        peer = conn.node_id or ""
        if isinstance(message, Incoming):
            channel = self._channel(stream, peer)
            await stream.send(Accept(), timeout=CONTROL_TIMEOUT_S)
            await channel.wait_closed()
            return
        if not self.relaying or conn.path == "relayed":
            await stream.send(Refused("not relaying"), timeout=CONTROL_TIMEOUT_S)
        elif isinstance(message, Reserve):
            await stream.send(self.book.reserve(peer, time.time()), timeout=CONTROL_TIMEOUT_S)
        elif isinstance(message, ConnectTo):
            await self._splice(stream, peer, message.target)
        else:
            await stream.send(Refused("unexpected message"), timeout=CONTROL_TIMEOUT_S)

    async def _splice(self, inbound: Stream, source: str, target: str) -> None:
        """Open the target's half of a circuit and forward packets both ways until it ends."""
        circuit = self.book.open(source, target, time.time())
        target_conn = self._relay_conn(target)
        if isinstance(circuit, Refused) or target_conn is None:
            self.book.close(getattr(circuit, "id", -1))
            reason = circuit.reason if isinstance(circuit, Refused) else f"{target[:8]} is not connected here"
            await inbound.send(Refused(reason), timeout=CONTROL_TIMEOUT_S)
            return
        try:
            outbound = await target_conn.open_stream(RELAY_STREAM)
            await outbound.send(Incoming(source), timeout=CONTROL_TIMEOUT_S)
            answer = await outbound.recv(RelayMessage, timeout=CONTROL_TIMEOUT_S)
            if not isinstance(answer, Accept):
                outbound.reset()
                await inbound.send(Refused(f"{target[:8]} declined"), timeout=CONTROL_TIMEOUT_S)
                return
            await inbound.send(Accept(), timeout=CONTROL_TIMEOUT_S)
            self._on_event("relay_circuit", source=source, target=target, circuit=circuit.id)
            pumps = [asyncio.create_task(self._pump(inbound, outbound, circuit.id)),
                     asyncio.create_task(self._pump(outbound, inbound, circuit.id))]
            try:
                await asyncio.wait(pumps, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for task in pumps:
                    task.cancel()
                inbound.reset()
                outbound.reset()
        finally:
            self.book.close(circuit.id)

    async def _pump(self, src: Stream, dst: Stream, circuit_id: int) -> None:
        with contextlib.suppress(StreamClosed):
            while (packet := await src.recv(bytes, timeout=None)) is not None:
                over = self.book.carry(circuit_id, len(packet), time.time())
                if over is not None:
                    log.info("closing relay circuit %d: %s", circuit_id, over)
                    return
                await dst.send(packet, timeout=None)

    # -- hole punching ------------------------------------------------------------------------------

    def _candidates(self) -> list[str]:
        host, _ = self.endpoint.local_addr
        listen = [] if host in ("0.0.0.0", "::") else [format_addr(self.endpoint.local_addr)]
        ours = [a for a in dict.fromkeys([*self.observed(), *listen]) if len(a) <= MAX_PUNCH_ADDR_LEN]
        return ours[:MAX_PUNCH_ADDRS]  # what PunchConnect's wire type admits

    async def _punch(self, conn: PeerConnection) -> None:
        """Initiator: trade addresses over the relayed ``conn``, then dial at the agreed moment."""
        peer = conn.node_id or ""
        loop = asyncio.get_running_loop()
        ok = False
        try:
            self._mark_punching(peer)
            stream = await conn.open_stream(PUNCH_STREAM)
            started = loop.time()
            await stream.send(PunchConnect(self._candidates()), timeout=CONTROL_TIMEOUT_S)
            reply = await stream.recv(PunchMessage, timeout=CONTROL_TIMEOUT_S)
            if not isinstance(reply, PunchConnect):
                raise DecodeError("expected the peer's addresses")
            rtt = loop.time() - started
            await stream.send(PunchSync(), timeout=CONTROL_TIMEOUT_S)
            stream.close()
            await asyncio.sleep(sync_delay(rtt))
            ok = await self._dial_direct(peer, reply.addrs)
        except MeshllmError as exc:
            log.debug("punch to %s failed: %s", peer[:8], exc)
        finally:
            self.schedule.finished(peer, ok, time.time())
        self._on_event("punch", node_id=peer, ok=ok)

    async def _serve_punch(self, stream: Stream, conn: PeerConnection) -> None:
        """Responder: answer with our addresses; on PunchSync, open our NAT towards the initiator."""
        peer = conn.node_id or ""
        first = await stream.recv(PunchMessage, timeout=CONTROL_TIMEOUT_S)
        if not isinstance(first, PunchConnect):
            return
        self._mark_punching(peer)
        await stream.send(PunchConnect(self._candidates()), timeout=CONTROL_TIMEOUT_S)
        if isinstance(await stream.recv(PunchMessage, timeout=CONTROL_TIMEOUT_S), PunchSync):
            if peer in self._mapping:
                return  # an earlier attempt is still opening our NAT towards this peer
            self._mapping.add(peer)
            spawn(self._tasks, self._open_mappings(peer, _ip_addrs(first.addrs)))

    async def _open_mappings(self, peer: str, targets: list[Addr]) -> None:
        """Send junk datagrams to the initiator's addresses until its handshake gets through.

        Each one creates (or refreshes) our NAT's mapping and conntrack entry towards the
        initiator, so its QUIC Initial is let in as a reply. The initiator's endpoint drops them
        (they parse as no QUIC packet). Only the initiator dials: two crossing handshakes would
        yield two direct connections and the loser's streams would be cut.
        """
        try:  # _serve_punch marked the peer in self._mapping
            loop = asyncio.get_running_loop()
            end = loop.time() + PUNCH_DIAL_TIMEOUT_S
            while loop.time() < end:
                current = self.endpoint.peers.get(peer)
                if current is None or current.path != "relayed":
                    return
                for addr in targets:
                    self.endpoint.sendto(PUNCH_PACKET, addr)
                await asyncio.sleep(PUNCH_PACKET_INTERVAL_S)
        finally:
            self._mapping.discard(peer)

    def _mark_punching(self, peer: str) -> None:
        self.endpoint.punching.add(peer)
        asyncio.get_running_loop().call_later(PUNCH_LABEL_S, self.endpoint.punching.discard, peer)

    async def _dial_direct(self, peer: str, addrs: list[str]) -> bool:
        """Dial every candidate at once; True when the peer's connection is no longer relayed."""
        targets = _ip_addrs(addrs)
        await asyncio.gather(*(
            self.endpoint.connect(addr, expected_node_id=peer, timeout=PUNCH_DIAL_TIMEOUT_S, fresh=True)
            for addr in targets
        ), return_exceptions=True)
        current = self.endpoint.peers.get(peer)
        return current is not None and current.path != "relayed"



def _ip_addrs(addrs: list[str]) -> list[Addr]:
    """The well-formed IP ``host:port`` candidates a peer sent, deduplicated, at most
    :data:`~meshllm.net.nat.MAX_PUNCH_ADDRS` of them (anything else is ignored)."""
    out: list[Addr] = []
    for text in addrs[:MAX_PUNCH_ADDRS * 4]:
        if len(out) >= MAX_PUNCH_ADDRS:
            break
        with contextlib.suppress(DecodeError):
            addr = parse_addr(text)
            if is_ip(addr[0]) and addr not in out:
                out.append(addr)
    return out
