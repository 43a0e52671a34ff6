"""Endpoint: one UDP socket that both accepts and dials QUIC connections.

Hole punching needs the packets we dial with to leave from the port peers reach us on, so every
connection of a node shares one socket (aioquic's ``connect()`` would open a new one each time).
Incoming datagrams are routed to their :class:`PeerConnection` by destination connection id; an
unknown id carried by a full-sized Initial packet starts a new incoming connection.

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
import ipaddress
import logging
import socket
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from aioquic.buffer import Buffer
from aioquic.quic.configuration import SMALLEST_MAX_DATAGRAM_SIZE
from aioquic.quic.packet import QuicPacketType, pull_quic_header
from nacl.signing import SigningKey

from meshllm.identity.ids import node_id
from meshllm.net.circuit import RelayChannel
from meshllm.net.connection import PeerConnection
from meshllm.net.errors import ConnectError, ConnectTimeout, PeerMismatch
from meshllm.net.events import PeerEvent, PeerEventKind
from meshllm.net.messages import KIND_MAX, Addr, CloseCode, is_virtual, normalize_addr
from meshllm.net.quic import IDLE_TIMEOUT, MAX_DATAGRAM_SIZE, STREAM_WINDOW, MeshQuicConnection, make_configuration
from meshllm.net.streams import SEND_BUDGET, Stream
from meshllm.wire.frames import CONTROL_FRAME_MAX

log = logging.getLogger(__name__)

Admit = Callable[[str, bytes, bool], None]
"""``admit(peer_node_id, proof, dialer)``: return to accept the peer, raise a MeshllmError to refuse.

``dialer`` is True when we dialed the peer: the mesh layer checks a peer it chose to dial
differently from a stranger that dialed it (see mesh/service.py)."""
StreamHandler = Callable[[Stream, PeerConnection], Awaitable[None]]
"""Serves one incoming stream; the stream is closed cleanly when it returns, reset if it raises."""


@dataclass(frozen=True)
class EndpointOptions:
    """Tunables; the defaults suit a LAN or the internet."""

    stream_window: int = STREAM_WINDOW
    """Most bytes a peer may send on one stream beyond what we have read."""
    send_budget: int = SEND_BUDGET
    """Most unsent bytes a stream holds before ``send`` waits."""
    max_datagram_size: int = MAX_DATAGRAM_SIZE
    idle_timeout: float = IDLE_TIMEOUT
    probe_interval: float = 0.25
    suspect_after: int = 3
    admission_timeout: float = 10.0
    """An incoming connection must finish admission within this long or is closed."""
    max_pending: int = 256
    """Most incoming connections still in handshake or admission; more Initials are dropped."""


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
        self, signing_key: SigningKey, admit: Admit, local_proof: Callable[[], bytes], options: EndpointOptions
    ) -> None:
        self.node_id = node_id(bytes(signing_key.verify_key))
        self.options = options
        self.admit = admit
        """The injected admission check (see :data:`Admit`)."""
        self.local_proof = local_proof
        """Returns the proof we present to peers (called once per connection)."""
        self.peers: dict[str, PeerConnection] = {}
        """Admitted, open connections by peer node id (one per peer)."""
        self._client_config = make_configuration(
            signing_key, is_client=True, stream_window=options.stream_window,
            max_datagram_size=options.max_datagram_size, idle_timeout=options.idle_timeout,
        )
        self._server_config = make_configuration(
            signing_key, is_client=False, stream_window=options.stream_window,
            max_datagram_size=options.max_datagram_size, idle_timeout=options.idle_timeout,
        )
        self._routes: dict[bytes, PeerConnection] = {}
        self._handlers: dict[str, tuple[StreamHandler, int]] = {}
        self._listeners: list[Callable[[PeerEvent], None]] = []
        self._dialing: dict[Addr, PeerConnection] = {}
        self._channels: dict[Addr, RelayChannel] = {}
        self.punching: set[str] = set()
        """Peers we are hole punching to: a direct connection admitted with them is ``punched``."""
        self._transport: asyncio.DatagramTransport | None = None
        self._closed = False

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
    ) -> Endpoint:
        """Bind the UDP socket (port 0 picks a free one) and start serving."""
        endpoint = cls(signing_key, admit, local_proof, options or EndpointOptions())
        loop = asyncio.get_running_loop()
        transport, _ = await loop.create_datagram_endpoint(lambda: _Socket(endpoint), local_addr=(host, port))
        endpoint._transport = transport  # type: ignore[assignment]
        return endpoint

    # -- public API ---------------------------------------------------------------------------

    @property
    def local_addr(self) -> Addr:
        """The bound (host, port)."""
        assert self._transport is not None
        return normalize_addr(self._transport.get_extra_info("sockname"))

    @property
    def observed_addrs(self) -> set[Addr]:
        """Our address as currently connected peers see it (candidates for NAT traversal)."""
        return {
            p.observed_addr for p in self.peers.values() if p.observed_addr is not None and p.path != "relayed"
        }

    def on_stream(self, kind: str, handler: StreamHandler, *, max_frame: int = CONTROL_FRAME_MAX) -> None:
        """Serve incoming streams of ``kind`` with ``handler``; ``max_frame`` caps their frames."""
        if not kind or len(kind) > KIND_MAX or kind == "admission":
            raise ValueError(f"bad stream kind {kind!r}")
        self._handlers[kind] = (handler, max_frame)

    def on_peer_event(self, callback: Callable[[PeerEvent], None]) -> Callable[[], None]:
        """Call ``callback`` on every peer event; returns a function that unsubscribes it."""
        self._listeners.append(callback)
        return lambda: self._listeners.remove(callback) if callback in self._listeners else None

    async def connect(
        self, addr: Addr, expected_node_id: str | None = None, timeout: float = 5.0, *, fresh: bool = False
    ) -> PeerConnection:
        """An admitted connection to the node at ``addr``, reusing an open one to that node.

        With ``expected_node_id`` the peer's certificate must carry that key (else
        :class:`PeerMismatch`); without it (a bootstrap address) the peer's id is learned.
        ``fresh`` dials even if we hold a connection to the peer (a direct path to a relayed peer).
        Raises :class:`ConnectTimeout`, :class:`AdmissionRefused` or :class:`ConnectError`.
        """
        if self._closed:
            raise ConnectError("endpoint is closed")
        if not is_virtual(addr):
            addr = await self._resolve(addr, timeout)
        existing = None if fresh else self._existing(addr, expected_node_id)
        if existing is not None:
            return existing
        conn = self._dialing.get(addr) or self._dial(addr, expected_node_id)
        try:
            await asyncio.wait_for(conn.wait_admitted(), timeout)
        except TimeoutError:
            conn.close("dial timed out", CloseCode.ADMISSION_TIMEOUT)
            raise ConnectTimeout(f"no admitted connection to {addr[0]}:{addr[1]} within {timeout}s") from None
        finally:
            if self._dialing.get(addr) is conn:
                del self._dialing[addr]
        if expected_node_id is not None and conn.node_id != expected_node_id:
            raise PeerMismatch(f"{addr[0]}:{addr[1]} is node {conn.node_id}, not {expected_node_id}")
        return self.peers.get(conn.node_id or "", conn)

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
        without talking; a redial by the same node replaces its older connection.
        """
        peer_id = conn.node_id or ""
        if conn.path == "direct" and peer_id in self.punching:
            conn.path = "punched"
        old = self.peers.get(peer_id)
        self.peers[peer_id] = conn
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
        if dialer_new != dialer_old and dialer_old < dialer_new:
            self.peers[peer_id] = old
            conn.close("duplicate connection", CloseCode.DUPLICATE)
        else:
            old.close("replaced by a newer connection", CloseCode.DUPLICATE)

    def removed(self, conn: PeerConnection) -> None:
        """``conn`` closed: report it if it was the peer's connection; end its relay circuit.

        The circuit outlives the connection by a moment so its CONNECTION_CLOSE gets through.
        """
        channel = self._channels.get(conn.remote_addr)
        if channel is not None:
            asyncio.get_running_loop().call_later(0.5, channel.close, "connection closed")
        if conn.node_id is not None and self.peers.get(conn.node_id) is conn:
            del self.peers[conn.node_id]
            self.emit(PeerEvent(PeerEventKind.CLOSED, conn.node_id, conn.rtt_ms, conn.close_reason or ""))

    # -- internals ----------------------------------------------------------------------------

    def datagram_received(self, data: bytes, addr: tuple[str, int]) -> None:
        try:
            header = pull_quic_header(Buffer(data=data), host_cid_length=self._server_config.connection_id_length)
        except ValueError:
            return
        conn = self._routes.get(header.destination_cid)
        if conn is None:
            if (
                self._closed
                or header.packet_type != QuicPacketType.INITIAL
                or len(data) < SMALLEST_MAX_DATAGRAM_SIZE
                or header.version not in self._server_config.supported_versions
                or self._pending() >= self.options.max_pending
            ):
                return
            quic = MeshQuicConnection(
                configuration=self._server_config, original_destination_connection_id=header.destination_cid
            )
            conn = PeerConnection(self, quic, _addr(addr), dialer=False, expected=None)
            self._routes[header.destination_cid] = conn
            self._routes[quic.host_cid] = conn
        conn.datagram_received(data, _addr(addr))

    def _dial(self, addr: Addr, expected: str | None) -> PeerConnection:
        quic = MeshQuicConnection(configuration=self._client_config)
        conn = PeerConnection(self, quic, addr, dialer=True, expected=expected)
        self._routes[quic.host_cid] = conn
        self._dialing[addr] = conn
        quic.connect(addr, now=asyncio.get_running_loop().time())
        conn.transmit()
        return conn

    def _existing(self, addr: Addr, expected: str | None) -> PeerConnection | None:
        if expected is not None:
            return self.peers.get(expected)
        return next((p for p in self.peers.values() if p.remote_addr == addr), None)

    def _pending(self) -> int:
        return len({c for c in self._routes.values() if not c.admitted and not c.dialer})

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


def _addr(addr: tuple[object, ...]) -> Addr:
    return addr if is_virtual(addr) else normalize_addr(addr)  # type: ignore[arg-type,return-value]
