"""Endpoint: one UDP socket that both accepts and dials QUIC connections.

Hole punching needs the packets we dial with to leave from the port peers reach us on, so every
connection of a node shares one socket (aioquic's ``connect()`` would open a new one each time).
Incoming datagrams are routed to their :class:`PeerConnection` by destination connection id; an
unknown id carried by a full-sized Initial packet starts a new incoming connection.

Pending handshakes are a resource a stranger can try to exhaust, so they are guarded in layers:
an Initial that does not decrypt is dropped before any state is kept; each source address and
each source IP may hold only a few pending handshakes; handshake and admission must complete
within ``admission_timeout``; and once more than ``retry_above`` handshakes are pending, new Initials
must first prove they can receive at their source address (a QUIC Retry with an encrypted token,
RFC 9000 section 8.1), so spoofed floods create no state at all, and must complete their handshake
within ``handshake_timeout``.

Peers that overstep a limit anywhere (transport or mesh layer) get strikes
(:meth:`Endpoint.strike`); enough strikes cool the peer down: its connection is closed and its
handshakes and our dials to it are refused for a while (:mod:`.limits`).

Typical use (the mesh layer supplies ``admit`` and ``local_proof``)::

    endpoint = await Endpoint.create(signing_key, "0.0.0.0", 9338, admit=admit, local_proof=proof)
    endpoint.on_stream("gossip", handle_gossip)          # async def handle_gossip(stream, peer)
    endpoint.on_peer_event(print)                         # connected / suspect / alive / closed
    peer = await endpoint.connect(("192.0.2.7", 9338), expected_node_id=their_id)
    stream = await peer.open_stream("gossip")
    await stream.send(Digest(...)); reply = await stream.recv(Digest, timeout=2.0)
    await endpoint.close()
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import os
import socket
from collections import Counter
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass

from aioquic.buffer import Buffer
from aioquic.quic.configuration import SMALLEST_MAX_DATAGRAM_SIZE
from aioquic.quic.packet import QuicPacketType, encode_quic_retry, pull_quic_header
from aioquic.quic.retry import QuicRetryTokenHandler
from nacl.signing import SigningKey

from meshllm.errors import MeshllmError
from meshllm.identity.ids import node_id
from meshllm.net.budget import FrameBudget
from meshllm.net.circuit import RelayChannel
from meshllm.net.connection import PeerConnection
from meshllm.net.errors import ConnectError, ConnectTimeout, PeerMismatch
from meshllm.net.events import PeerEvent, PeerEventKind
from meshllm.net.limits import COOL_DOWN_S, CoolDowns, Strikes
from meshllm.net.messages import KIND_MAX, Addr, CloseCode, is_virtual, normalize_addr
from meshllm.net.quic import (
    ACCEPT_IDLE_TIMEOUT,
    CONNECTION_WINDOW,
    IDLE_TIMEOUT,
    MAX_DATAGRAM_SIZE,
    STREAM_WINDOW,
    MeshQuicConnection,
    initial_decrypts,
    make_configuration,
)
from meshllm.net.streams import SEND_BUDGET, Stream
from meshllm.net.traffic import StreamTraffic
from meshllm.wire.addr import parse_addr
from meshllm.wire.frames import CONTROL_FRAME_MAX

log = logging.getLogger(__name__)

DIAL_RACE_S = 1.0
"""Two connections with one peer are a simultaneous dial only while the older still hears the peer
(probes, gossip or the handshake itself arrive well within this); silent longer, it is a dead one."""
FRAME_BUDGET = 40 * 1024 * 1024
"""Default frame budget per connection: one 32 MiB stage-lane frame plus room for smaller large ones."""
TOTAL_FRAME_BUDGET = 48 * 1024 * 1024
"""Default frame budget of the whole endpoint."""

Admit = Callable[[str, bytes, bool], "bytes | None"]
"""``admit(peer_node_id, proof, dialer)``: return to accept the peer, raise a MeshllmError to refuse.

``dialer`` is True when we dialed the peer: the mesh layer checks a peer it chose to dial
differently from a stranger that dialed it (see mesh/service.py). Bytes returned when accepting a
dialer travel to it in the Welcome (the mesh layer's admission grant)."""
TakeGrant = Callable[[str, bytes], None]
"""``take_grant(peer_node_id, grant)``: a peer we dialed accepted us and gave us ``grant``."""
StreamHandler = Callable[[Stream, PeerConnection], Awaitable[None]]
"""Serves one incoming stream; the stream is closed cleanly when it returns, reset if it raises."""


@dataclass(frozen=True)
class EndpointOptions:
    """Tunables; the defaults suit a LAN or the internet."""

    stream_window: int = STREAM_WINDOW
    """Most bytes a peer may send on one stream beyond what we have read."""
    connection_window: int = CONNECTION_WINDOW
    """Most bytes a peer may send over all its streams beyond what we have read."""
    frame_budget: int = FRAME_BUDGET
    """Room per connection for frames larger than half a stream window, partial or unread (budget.py)."""
    total_frame_budget: int = TOTAL_FRAME_BUDGET
    """The same room for all connections together: what many peers at once can make us hold."""
    send_budget: int = SEND_BUDGET
    """Most unsent bytes a stream holds before ``send`` waits."""
    max_datagram_size: int = MAX_DATAGRAM_SIZE
    idle_timeout: float = IDLE_TIMEOUT
    accept_idle_timeout: float = ACCEPT_IDLE_TIMEOUT
    """The idle timeout we advertise to dialers. QUIC takes the smaller of both sides', so this longer one
    lengthens only connections whose dialer asks for as much: passive clients, whose route-table pulls are
    all the traffic on their anchor connection (mesh/passive.py). Members dial with ``idle_timeout``."""
    probe_interval: float = 0.25
    """Seconds between datagram probes while a connection carries work (a stream not of a ``quiet_kinds``
    kind) or its peer is suspect: 3 missed make a peer that dies mid-answer suspect within a second."""
    idle_probe_interval: float | None = 0.25
    """Seconds between probes while a connection carries no work: they keep its RTT measured. ``None`` (a
    passive client): not probed then, so a quiet connection costs the member at the other end nothing. A
    member probes quiet connections slowly: its failure detector (mesh/failure.py) watches them."""
    quiet_kinds: frozenset[str] = frozenset()
    """Stream kinds that are not work for :attr:`probe_interval` (a member's gossip: its own detector)."""
    passive: bool = False
    """We are a passive client: dialed peers are told so (``Hello.passive``) and keep us out of gossip."""
    suspect_after: int = 3
    admission_timeout: float = 10.0
    """A connection must finish admission within this long or is closed: an incoming one, and a dial
    however long its callers wait (:meth:`Endpoint.connect`)."""
    handshake_timeout: float = 3.0
    """Once ``retry_above`` handshakes are pending (a flood), an incoming connection must finish its TLS
    handshake within this long or is dropped; before, it has ``admission_timeout``."""
    max_pending: int = 256
    """Most incoming connections still in handshake or admission; more Initials are dropped."""
    max_pending_per_ip: int = 32
    max_pending_per_addr: int = 4
    """Pending handshakes one source IP, and one source address (IP and port), may hold."""
    retry_above: int = 32
    """Pending handshakes above which a new Initial must first answer a Retry (address validation)."""
    startup_wait_s: float = 0.0
    """Until :meth:`Endpoint.started`, how long a stream of a kind no handler serves yet waits for one.
    A node's services register their kinds after its endpoint opened and its peers heard of it: a
    coordinator that asked a new worker for a stage that early was refused (``UNKNOWN_KIND``), and its
    whole placement failed. 0 (a bare endpoint): refused at once."""


class _Socket(asyncio.DatagramProtocol):
    def __init__(self, endpoint: Endpoint) -> None:
        self.endpoint = endpoint

    def datagram_received(self, data: bytes, addr: tuple[str, int]) -> None:
        self.endpoint.datagram_received(data, addr)

    def error_received(self, exc: Exception) -> None:
        log.debug("UDP socket error: %s", exc)


class Endpoint:
    """A node's QUIC endpoint: its connections, stream handlers and peer events."""

    def __init__(
        self, signing_key: SigningKey, admit: Admit, local_proof: Callable[[], bytes], options: EndpointOptions,
        take_grant: TakeGrant | None = None,
    ) -> None:
        self.node_id = node_id(bytes(signing_key.verify_key))
        self.options = options
        self.admit = admit
        """The injected admission check (see :data:`Admit`)."""
        self.admit_passive: Admit | None = None
        """The check for a dialer whose Hello says it is a passive client (None: ``admit`` for it too)."""
        self.on_datagram: Callable[[PeerConnection, bytes], None] | None = None
        """Takes an admitted member's datagrams that are not the transport's probes (the failure
        detector's pings); None: they are dropped."""
        self.local_proof = local_proof
        """Returns the proof we present to peers (called once per connection)."""
        self.patience: Callable[[str], int] = lambda node_id: 1
        """How many times its base deadlines a wait on ``node_id`` gets: the mesh's failure detector sets
        it to its local-health stretch (mesh/failure.py), so an overloaded host's request probes and
        dials wait longer instead of giving up on a peer that is only slow."""
        self.take_grant = take_grant
        """Handles what a peer we dialed granted us (None: grants are ignored)."""
        self.peers: dict[str, PeerConnection] = {}
        """Admitted, open connections by peer node id (one per peer)."""
        self.traffic = StreamTraffic()
        """Stream bytes sent and received per stream kind, over every connection (``/metrics``)."""
        self._client_config = make_configuration(
            signing_key, is_client=True, stream_window=options.stream_window,
            connection_window=options.connection_window,
            max_datagram_size=options.max_datagram_size, idle_timeout=options.idle_timeout,
        )
        self._server_config = make_configuration(
            signing_key, is_client=False, stream_window=options.stream_window,
            connection_window=options.connection_window,
            max_datagram_size=options.max_datagram_size, idle_timeout=options.accept_idle_timeout,
        )
        self._routes: dict[bytes, PeerConnection] = {}
        self._handlers: dict[str, tuple[StreamHandler, int]] = {}
        self.starting = options.startup_wait_s > 0
        """Until :meth:`started`: a stream of a kind no handler serves yet waits for one."""
        self._registered = asyncio.Event()
        """Set (and replaced) whenever a handler is registered: wakes the streams waiting for one."""
        self._listeners: list[Callable[[PeerEvent], None]] = []
        self._dialing: dict[Addr, PeerConnection] = {}
        self.peers_version = 0
        """Bumped whenever :attr:`peers` changes: what is read from every connection at every tick is kept
        until then (a member's passive clients' connections, hundreds perhaps, cost it nothing per tick)."""
        self._observed: tuple[int, frozenset[Addr]] = (-1, frozenset())
        """:attr:`observed_addrs` and the :attr:`peers_version` it was read at."""
        self._channels: dict[Addr, RelayChannel] = {}
        self.punching: set[str] = set()
        """Peers we are hole punching to: a direct connection admitted with them is ``punched``."""
        self._transport: asyncio.DatagramTransport | None = None
        self._closed = False
        self._pending_total = 0
        self._pending_ips: Counter[str] = Counter()
        self._pending_addrs: Counter[Addr] = Counter()
        self._retry = QuicRetryTokenHandler()
        self.frames = FrameBudget(options.total_frame_budget, options.frame_budget)
        """Room for large frames, shared by every connection (streams reserve from it)."""
        self._strikes: Strikes[str] = Strikes()
        self._cooling: CoolDowns[str] = CoolDowns()
        self.on_cool_down: Callable[[str, str], None] | None = None
        """Called with (peer node id, reason) when a peer is cooled down (the mesh layer logs it)."""

    @classmethod
    async def create(
        cls,
        signing_key: SigningKey,
        host: str = "0.0.0.0",
        port: int = 0,
        *,
        admit: Admit,
        local_proof: Callable[[], bytes],
        options: EndpointOptions | None = None,
        take_grant: TakeGrant | None = None,
    ) -> Endpoint:
        """Bind the UDP socket (port 0 picks a free one) and start serving."""
        endpoint = cls(signing_key, admit, local_proof, options or EndpointOptions(), take_grant)
        loop = asyncio.get_running_loop()
        transport, _ = await loop.create_datagram_endpoint(lambda: _Socket(endpoint), local_addr=(host, port))
        endpoint._transport = transport  # type: ignore[assignment]
        _enlarge_buffers(transport.get_extra_info("socket"))
        return endpoint

    # -- public API ---------------------------------------------------------------------------

    @property
    def local_addr(self) -> Addr:
        """The bound (host, port)."""
        assert self._transport is not None
        return normalize_addr(self._transport.get_extra_info("sockname"))

    @property
    def observed_addrs(self) -> frozenset[Addr]:
        """Our address as currently connected peers see it (candidates for NAT traversal).

        Kept from one change of :attr:`peers` to the next: the mesh asks at every tick, and walking a
        member's connections, its passive clients' included, was much of what 50 clients cost it.
        """
        if self._observed[0] != self.peers_version:
            self._observed = self.peers_version, frozenset(
                p.observed_addr for p in self.peers.values() if p.observed_addr is not None and p.path != "relayed"
            )
        return self._observed[1]

    def on_stream(self, kind: str, handler: StreamHandler, *, max_frame: int = CONTROL_FRAME_MAX) -> None:
        """Serve incoming streams of ``kind`` with ``handler``; ``max_frame`` caps their frames."""
        if not kind or len(kind) > KIND_MAX or kind == "admission":
            raise ValueError(f"bad stream kind {kind!r}")
        self._handlers[kind] = (handler, max_frame)
        self._registered.set()
        self._registered = asyncio.Event()

    def started(self) -> None:
        """Every service has registered its stream kinds: from now on a stream of any other kind is
        refused at once (``EndpointOptions.startup_wait_s``)."""
        self.starting = False
        self._registered.set()

    async def handler_once_started(self, kind: str) -> tuple[StreamHandler, int] | None:
        """The handler for ``kind`` once one is registered; None if none is by the time the node has
        started, or after ``EndpointOptions.startup_wait_s``."""
        deadline = asyncio.get_running_loop().time() + self.options.startup_wait_s
        while (registered := self._handlers.get(kind)) is None and self.starting:
            left = deadline - asyncio.get_running_loop().time()
            if left <= 0:
                return None
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._registered.wait(), left)
        return registered

    def on_peer_event(self, callback: Callable[[PeerEvent], None]) -> Callable[[], None]:
        """Call ``callback`` on every peer event; returns a function that unsubscribes it."""
        self._listeners.append(callback)
        return lambda: self._listeners.remove(callback) if callback in self._listeners else None

    async def connect(
        self, addr: Addr, expected_node_id: str | None = None, timeout: float = 5.0, *, fresh: bool = False,
    ) -> PeerConnection:
        """An admitted connection to the node at ``addr``, reusing an open one to that node.

        With ``expected_node_id`` the peer's certificate must carry that key (else
        :class:`PeerMismatch`); without it (a bootstrap address) the peer's id is learned.
        ``fresh`` dials even if we hold a connection to the peer (a direct path to a relayed peer).
        Raises :class:`ConnectTimeout`, :class:`AdmissionRefused` or :class:`ConnectError`.

        A dial outlives the ``timeout`` of the caller that started it, up to ``admission_timeout`` (the
        acceptor's limit too), and a later call for the same address joins it. On 50 nodes sharing two
        cores a handshake and admission took over 3 s: each dial closed at its 3 s, the next started from
        scratch and failed the same way, and a member could not connect to a live peer for 17 s
        (docs/benchmarks.md).
        """
        if self._closed:
            raise ConnectError("endpoint is closed")
        if expected_node_id is not None and (left := self.cooling(expected_node_id)):
            raise ConnectError(f"node {expected_node_id[:8]} is cooling down for {left:.0f} s (it overstepped limits)")
        if not is_virtual(addr):
            addr = await self._resolve(addr, timeout)
        existing = None if fresh else self._existing(addr, expected_node_id)
        if existing is not None:
            return existing
        conn = self._dialing.get(addr)
        if conn is None:
            conn = self._dial(addr, expected_node_id)
        try:
            await asyncio.wait_for(conn.wait_admitted(), timeout)
        except TimeoutError:
            raise ConnectTimeout(f"no admitted connection to {addr[0]}:{addr[1]} within {timeout}s") from None
        if expected_node_id is not None and conn.node_id != expected_node_id:
            raise PeerMismatch(f"{addr[0]}:{addr[1]} is node {conn.node_id}, not {expected_node_id}")
        return self.peers.get(conn.node_id or "", conn)

    async def connect_node(self, node_id: str, addrs: Iterable[str], timeout: float) -> PeerConnection:
        """The open connection to ``node_id``, else the first admitted dial among its gossiped ``addrs``.

        Each distinct address is tried once, in order, for up to ``timeout`` (a record lists an
        address both as its own and as observed by peers: dialing a dead node twice there doubled
        a failover). :class:`ConnectError` naming every failure when none answers.
        """
        conn = self.peers.get(node_id)
        if conn is not None:
            return conn
        errors = []
        for text in dict.fromkeys(addrs):
            try:
                return await self.connect(parse_addr(text), expected_node_id=node_id, timeout=timeout)
            except (MeshllmError, OSError) as exc:
                errors.append(f"{text}: {exc}")
        raise ConnectError("; ".join(errors) or "no address known")

    def strike(self, conn: PeerConnection, reason: str) -> None:
        """Count one overstep by ``conn``'s peer; enough of them cool it down."""
        if conn.node_id is None:
            conn.discard(reason)
            return
        if self._strikes.add(conn.node_id, self._now()):
            self.cool_down(conn.node_id, reason)

    def cool_down(self, node_id: str, reason: str, seconds: float = COOL_DOWN_S) -> None:
        """Cut ``node_id`` off now and refuse it for ``seconds``: memory it held is released."""
        self._cooling.add(node_id, self._now(), seconds)
        log.warning("cooling down peer %s for %.0f s: %s", node_id[:8], seconds, reason)
        for conn in [c for c in {*self._routes.values(), *self.peers.values()} if c.node_id == node_id]:
            conn.close(f"cooling down: {reason}", CloseCode.MISBEHAVING)
        if self.on_cool_down is not None:
            self.on_cool_down(node_id, reason)

    def cooling(self, node_id: str) -> float:
        """Seconds ``node_id`` stays cooled down (0.0: it is welcome)."""
        return self._cooling.remaining(node_id, self._now())

    def attach(self, channel: RelayChannel) -> None:
        """Route packets for ``channel.addr`` (a virtual address) into the relay circuit."""
        self._channels[channel.addr] = channel

    def detach(self, addr: Addr, reason: str) -> None:
        """The circuit behind ``addr`` ended: connections on it are over (their peer is cut off)."""
        if self._channels.pop(addr, None) is None:
            return
        for conn in {*self._routes.values(), *self.peers.values(), *self._dialing.values()}:
            if conn.remote_addr == addr:
                conn.close(reason)

    async def close(self) -> None:
        """Close every connection (peers get CONNECTION_CLOSE) and the socket."""
        if self._closed:
            return
        self._closed = True
        for channel in list(self._channels.values()):
            channel.close("endpoint closing")
        conns = set(self._routes.values()) | set(self.peers.values()) | set(self._dialing.values())
        for conn in conns:
            conn.close("endpoint closing")
            conn.abandon()
        self._routes.clear()
        if self._transport is not None:
            self._transport.close()
        await asyncio.sleep(0)

    # -- used by PeerConnection ---------------------------------------------------------------

    def sendto(self, data: bytes, addr: tuple[str, int]) -> None:
        if is_virtual(addr):
            channel = self._channels.get(addr)
            if channel is not None:
                channel.send(data)
            return
        if self._transport is not None and not self._transport.is_closing():
            self._transport.sendto(data, addr)

    def route(self, cid: bytes, conn: PeerConnection) -> None:
        self._routes[cid] = conn

    def unroute(self, cid: bytes) -> None:
        self._routes.pop(cid, None)

    def forget(self, conn: PeerConnection) -> None:
        """aioquic is done with ``conn``: stop routing its packets."""
        self._settle(conn)
        for cid in [c for c, owner in self._routes.items() if owner is conn]:
            del self._routes[cid]

    def handler_for(self, kind: str) -> tuple[StreamHandler, int] | None:
        return self._handlers.get(kind)

    def emit(self, event: PeerEvent) -> None:
        for callback in list(self._listeners):
            try:
                callback(event)
            except Exception:
                log.exception("peer event callback failed on %s", event)

    def admitted(self, conn: PeerConnection) -> None:
        """``conn`` finished admission: keep exactly one connection per peer.

        A direct path beats a relayed one: the relayed connection is retired (closed once idle)
        and the switch is reported as UPGRADED. Between two of the same kind, if both nodes
        dialed each other, both keep the connection dialed by the smaller node id, so they agree
        without talking; a redial by the same node replaces its older connection. So does a dial by
        the peer while the connection we hold has been silent for :data:`DIAL_RACE_S`: that is not a
        race but a peer that no longer holds it (killed and started again), and keeping the dead one
        refused the restarted node until the dead one timed out.
        """
        self._settle(conn)
        self._dialed(conn)
        peer_id = conn.node_id or ""
        if conn.path == "direct" and peer_id in self.punching:
            conn.path = "punched"
        old = self.peers.get(peer_id)
        self.peers[peer_id] = conn
        self.peers_version += 1
        if old is None:
            self.emit(PeerEvent(PeerEventKind.CONNECTED, peer_id, conn.rtt_ms))
            return
        if (old.path == "relayed") != (conn.path == "relayed"):
            if conn.path == "relayed":
                self.peers[peer_id] = old
                conn.close("a direct path exists", CloseCode.DUPLICATE)
            else:
                old.retire("upgraded to a direct path")
                self.emit(PeerEvent(PeerEventKind.UPGRADED, peer_id, conn.rtt_ms))
            return
        dialer_new = self.node_id if conn.dialer else peer_id
        dialer_old = self.node_id if old.dialer else peer_id
        racing = old.silent_s < DIAL_RACE_S
        if racing and dialer_new != dialer_old and dialer_old < dialer_new:
            self.peers[peer_id] = old
            conn.close("duplicate connection", CloseCode.DUPLICATE)
        else:
            old.close("replaced by a newer connection", CloseCode.DUPLICATE)

    def removed(self, conn: PeerConnection) -> None:
        """``conn`` closed: report it if it was the peer's connection; end its relay circuit.

        The circuit outlives the connection by a moment so its CONNECTION_CLOSE gets through.
        """
        self._settle(conn)
        self._dialed(conn)
        channel = self._channels.get(conn.remote_addr)
        if channel is not None:
            asyncio.get_running_loop().call_later(0.5, channel.close, "connection closed")
        if conn.node_id is not None and self.peers.get(conn.node_id) is conn:
            del self.peers[conn.node_id]
            self.peers_version += 1
            self.emit(PeerEvent(PeerEventKind.CLOSED, conn.node_id, conn.rtt_ms, conn.close_reason or ""))

    # -- internals ----------------------------------------------------------------------------

    def datagram_received(self, data: bytes, addr: tuple[str, int]) -> None:
        try:
            header = pull_quic_header(Buffer(data=data), host_cid_length=self._server_config.connection_id_length)
        except ValueError:
            return
        conn = self._routes.get(header.destination_cid)
        if conn is not None:
            conn.datagram_received(data, _addr(addr))
            return
        if (
            self._closed
            or header.packet_type != QuicPacketType.INITIAL
            or len(data) < SMALLEST_MAX_DATAGRAM_SIZE
            or header.version not in self._server_config.supported_versions
        ):
            return
        source = _addr(addr)
        if (
            self._pending_total >= self.options.max_pending
            or self._pending_ips[source[0]] >= self.options.max_pending_per_ip
            or self._pending_addrs[source] >= self.options.max_pending_per_addr
            or not initial_decrypts(data, self._server_config.connection_id_length)
        ):
            return  # garbage is dropped here, before any state (or any Retry) is made for it
        original_dcid, retry_cid = header.destination_cid, None
        if not is_virtual(source) and (header.token or self._pending_total >= self.options.retry_above):
            if not header.token:
                self._send_retry(header, source)
                return
            try:
                original_dcid = self._retry.validate_token(
                    address=source, destination_cid=header.destination_cid, token=header.token, now=self._now()
                )
            except ValueError:
                return  # forged, stale or for another address: no state, no answer
            retry_cid = header.destination_cid
        quic = MeshQuicConnection(
            configuration=self._server_config, original_destination_connection_id=original_dcid,
            retry_source_connection_id=retry_cid,
        )
        # The short handshake deadline is for floods: while fewer than retry_above are pending a handshake
        # has the whole admission time (on 50 nodes sharing two cores, 4 % of them took over 3 s).
        flood = self._pending_total >= self.options.retry_above
        conn = PeerConnection(self, quic, source, dialer=False, expected=None,
                              handshake_s=self.options.handshake_timeout if flood else None)
        conn.datagram_received(data, source)
        if not quic.started:
            conn.discard("initial packet did not decrypt")  # garbage: keep nothing
            return
        self._routes[header.destination_cid] = conn
        self._routes[quic.host_cid] = conn
        conn.pending_source = source
        self._pending_total += 1
        self._pending_ips[source[0]] += 1
        self._pending_addrs[source] += 1

    def _send_retry(self, header: object, source: Addr) -> None:
        """Answer an Initial with a Retry whose token proves, when echoed, that the source is real."""
        retry_cid = os.urandom(8)
        token = self._retry.create_token(
            address=source, original_destination_connection_id=header.destination_cid,  # type: ignore[attr-defined]
            retry_source_connection_id=retry_cid, now=self._now(),
        )
        packet = encode_quic_retry(
            version=header.version, source_cid=retry_cid,  # type: ignore[attr-defined]
            destination_cid=header.source_cid,  # type: ignore[attr-defined]
            original_destination_cid=header.destination_cid, retry_token=token,  # type: ignore[attr-defined]
        )
        self.sendto(packet, source)

    def _settle(self, conn: PeerConnection) -> None:
        """An incoming connection stopped pending (admitted, or gone): free its slot."""
        addr = conn.pending_source
        if addr is None:
            return
        conn.pending_source = None
        self._pending_total -= 1
        for counter, key in ((self._pending_ips, addr[0]), (self._pending_addrs, addr)):
            counter[key] -= 1  # type: ignore[index]
            if counter[key] <= 0:  # type: ignore[index]
                del counter[key]  # type: ignore[attr-defined]

    def _now(self) -> float:
        return asyncio.get_running_loop().time()

    def _dial(self, addr: Addr, expected: str | None) -> PeerConnection:
        quic = MeshQuicConnection(configuration=self._client_config)
        conn = PeerConnection(self, quic, addr, dialer=True, expected=expected)
        self._routes[quic.host_cid] = conn
        self._dialing[addr] = conn
        quic.connect(addr, now=asyncio.get_running_loop().time())
        conn.transmit()
        return conn

    def _dialed(self, conn: PeerConnection) -> None:
        """``conn`` is admitted or gone: a dial for its address starts afresh from now on."""
        if conn.dialer:
            self._dialing = {addr: dialing for addr, dialing in self._dialing.items() if dialing is not conn}

    def _existing(self, addr: Addr, expected: str | None) -> PeerConnection | None:
        if expected is not None:
            return self.peers.get(expected)
        return next((p for p in self.peers.values() if p.remote_addr == addr), None)

    async def _resolve(self, addr: Addr, timeout: float) -> Addr:
        host, port = addr
        try:
            ipaddress.ip_address(host)
            return (host, int(port))
        except ValueError:
            pass
        loop = asyncio.get_running_loop()
        try:
            family = self._transport.get_extra_info("socket").family if self._transport else 0
            infos = await asyncio.wait_for(
                loop.getaddrinfo(host, port, family=family, type=socket.SOCK_DGRAM), timeout
            )
        except (OSError, TimeoutError) as exc:
            raise ConnectError(f"cannot resolve {host!r}: {exc}") from exc
        return normalize_addr(infos[0][4])


SOCKET_BUFFER = 4 * 1024 * 1024
"""UDP socket buffers we ask for: one socket carries every peer, so a burst from one (a bulk
transfer, a flood) must not overflow it and drop another's probes. The kernel may grant less."""


def _enlarge_buffers(sock: socket.socket | None) -> None:
    if sock is None:
        return
    for option in (socket.SO_RCVBUF, socket.SO_SNDBUF):
        try:
            sock.setsockopt(socket.SOL_SOCKET, option, SOCKET_BUFFER)
        except OSError as exc:  # some platforms refuse large buffers: keep the default
            log.debug("cannot enlarge the UDP socket buffer: %s", exc)


def _addr(addr: tuple[object, ...]) -> Addr:
    return addr if is_virtual(addr) else normalize_addr(addr)  # type: ignore[arg-type,return-value]
