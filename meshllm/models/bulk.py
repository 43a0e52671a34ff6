"""The bulk channel: model bytes over TLS 1.3 on TCP, mutually authenticated by node keys.

Why a second transport: aioquic spends 60-130 us of Python per packet, so one QUIC stream moves
10-15 MB/s at Ethernet packet sizes, while the kernel's TCP with the ``ssl`` module moves hundreds
(``bench/models.py``, docs/architecture.md). Stage lanes stay on QUIC (their frames are small);
layer transfers take this channel wherever the peer offers one and the QUIC path to it is direct.

**Authentication**: both ends present their node key (``net/tcp_tls.py``). The dialer checks the
listener's certificate against the node id it dialled; the listener serves only a node that is
connected and admitted over QUIC right now (``allowed``), so membership, revocations and cool-downs
are the QUIC endpoint's, unchanged. The dialer dials only after its QUIC connection to the peer
proved who the peer is, at the host that connection reaches (``ModelStore``).

**Protocol** (one request at a time per connection; connections are kept for the next request):
the dialer sends a ``Want`` frame (``models/transfer.py``); the listener answers ``Sending{offset,
length}`` followed by exactly ``length`` raw bytes, or ``Refused{message}``. Pieces are checked
against the signed manifest by the fetch (``transfer.fetch``), exactly as over QUIC.

**Limits**: at most :data:`PER_PEER` connections per peer and :data:`TOTAL` in all; the TLS handshake,
the wait for a request, and every read and write have deadlines; one request asks for at most
``MAX_WANT`` bytes.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import Awaitable, Callable
from typing import Annotated

import msgspec
from msgspec import Meta
from nacl.signing import SigningKey

from meshllm.errors import DecodeError, MeshllmError
from meshllm.identity.ids import short
from meshllm.models.transfer import (
    MAX_WANT,
    STALL_S,
    Locate,
    Pace,
    RangeRefused,
    Refused,
    TransferFailed,
    Want,
    open_range,
    read_chunk,
)
from meshllm.net import tcp_tls
from meshllm.net.errors import NetError
from meshllm.wire.frames import HEADER, FrameDecoder, decode_frame, encode_frame

log = logging.getLogger(__name__)

FRAME_MAX = 4096
"""Control frames (``Want``, ``Sending``, ``Refused``) are small."""
CHUNK = 1 << 20
"""Bytes read from disk and written to the socket at a time."""
CONNECT_S = 3.0
HANDSHAKE_S = 5.0
IDLE_S = 30.0
"""A listener closes a connection that asks for nothing for this long."""
KEEP_S = IDLE_S / 2
"""A dialer reuses an idle connection only this long, well before the listener would close it."""
PER_PEER = 6
"""Connections one peer may hold: two fetches' request windows (2 each) and its stage lanes (one per
direction of a hop, ``split/tcp_lane.py``), with room for one more."""
TOTAL = 32
KEEP_PER_PEER = 2


class Sending(msgspec.Struct, frozen=True, kw_only=True, tag="sending"):
    offset: Annotated[int, Meta(ge=0)]
    length: Annotated[int, Meta(ge=1, le=MAX_WANT)]


Reply = Sending | Refused


class OpenLane(msgspec.Struct, frozen=True, kw_only=True, tag="open-lane"):
    """First frame of a connection that carries a stage lane instead of requests (``split/tcp_lane.py``)."""


First = Want | OpenLane
LaneHandler = Callable[[asyncio.StreamReader, asyncio.StreamWriter, str], Awaitable[None]]
"""``handler(reader, writer, peer_id)``: serves a stage lane on an accepted connection until it ends."""


class BulkUnavailable(NetError):
    """The bulk channel to a peer did not work (dial, handshake, or the connection broke): use QUIC."""


# -- the sans-IO core ---------------------------------------------------------------------------


class ReplyParser:
    """The dialer's view of one reply: a ``Sending``/``Refused`` frame, then exactly the bytes announced.

    ``feed`` raises :class:`DecodeError` on anything else (a bad frame, another range than asked for,
    bytes past the end); ``refused`` holds a refusal's message; ``done`` says the reply is complete.
    """

    def __init__(self, want: Want) -> None:
        self.want = want
        self.refused: str | None = None
        self.data = bytearray()
        self._head = bytearray()
        self._sending = False

    @property
    def done(self) -> bool:
        return self.refused is not None or (self._sending and len(self.data) == self.want.length)

    def feed(self, data: bytes) -> None:
        if self.done:
            if data:
                raise DecodeError("bytes after the end of a reply")
            return
        if not self._sending:
            self._head += data
            if len(self._head) < HEADER.size:
                return
            size = HEADER.size + HEADER.unpack_from(self._head)[0]
            if size > FRAME_MAX:
                raise DecodeError(f"reply frame of {size} bytes exceeds the {FRAME_MAX}-byte cap")
            if len(self._head) < size:
                return
            reply = decode_frame(bytes(self._head[:size]), Reply, FRAME_MAX)
            data, self._head = bytes(self._head[size:]), bytearray()
            if isinstance(reply, Refused):
                self.refused = reply.message
                if data:
                    raise DecodeError("bytes after a refusal")
                return
            if (reply.offset, reply.length) != (self.want.offset, self.want.length):
                raise DecodeError(f"asked for {self.want.length} bytes at {self.want.offset}, "
                                  f"offered {reply.length} at {reply.offset}")
            self._sending = True
        if len(self.data) + len(data) > self.want.length:
            raise DecodeError("more bytes than announced")
        self.data += data


# -- the listener ------------------------------------------------------------------------------


class BulkServer:
    """Serves model ranges over TLS on TCP to peers ``allowed`` says are admitted."""

    def __init__(self, signing_key: SigningKey, locate: Locate, allowed: Callable[[str], bool],
                 pace: Pace | None = None) -> None:
        """``pace``: the node's upload cap, shared with its QUIC transfers (None: none)."""
        self.locate = locate
        self.allowed = allowed
        self.pace = pace
        self._ssl, _ = tcp_tls.contexts(signing_key)
        self._server: asyncio.Server | None = None
        self._per_peer: dict[str, int] = {}
        self._open = 0
        self.sent: dict[str, int] = {}
        """Bytes served per peer (node id), for status and tests."""
        self.on_lane: LaneHandler | None = None
        """Who serves stage lanes opened on this channel (None: such connections are closed)."""

    async def start(self, host: str, port: int = 0) -> int:
        """Listen on ``host:port`` (0: any free port); returns the port."""
        self._server = await asyncio.start_server(self._handle, host, port, ssl=self._ssl,
                                                  ssl_handshake_timeout=HANDSHAKE_S)
        return int(self._server.sockets[0].getsockname()[1])

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._server.wait_closed(), 2.0)

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = ""
        try:
            peer = tcp_tls.peer_node_id(writer.get_extra_info("ssl_object"))
            if not self.allowed(peer):
                log.info("bulk channel: refused node %s (not an admitted peer)", short(peer))
                return
            if self._open >= TOTAL or self._per_peer.get(peer, 0) >= PER_PEER:
                log.info("bulk channel: refused node %s (too many connections)", short(peer))
                return
            self._open += 1
            self._per_peer[peer] = self._per_peer.get(peer, 0) + 1
            try:
                first = await self._first(reader)
                if isinstance(first, OpenLane):
                    if self.on_lane is not None:  # the dialer waits for this echo before it sends lane frames
                        writer.write(encode_frame(OpenLane(), FRAME_MAX))
                        await self.on_lane(reader, writer, peer)
                    return
                if first is not None:
                    await self._answer(writer, peer, first)
                decoder: FrameDecoder[Want] = FrameDecoder(Want, FRAME_MAX)
                while first is not None and (want := await self._request(reader, decoder)) is not None:
                    await self._answer(writer, peer, want)
            finally:
                self._open -= 1
                self._per_peer[peer] -= 1
                if not self._per_peer[peer]:
                    del self._per_peer[peer]
        except (OSError, TimeoutError, DecodeError, MeshllmError, ValueError, asyncio.IncompleteReadError) as exc:
            log.info("bulk channel to %s ended: %s", short(peer) if peer else "a peer", exc)
        finally:
            writer.close()

    async def _first(self, reader: asyncio.StreamReader) -> First | None:
        """The connection's first frame, read exactly (a lane's frames may follow it at once), or None
        when the peer hung up or sent nothing within ``IDLE_S``."""
        try:
            head = await asyncio.wait_for(reader.readexactly(HEADER.size), IDLE_S)
        except (TimeoutError, asyncio.IncompleteReadError):
            return None
        (length,) = HEADER.unpack(head)
        if length > FRAME_MAX:
            raise DecodeError(f"a {length}-byte first frame; cap is {FRAME_MAX}")
        body = await asyncio.wait_for(reader.readexactly(length), STALL_S)
        first: First = decode_frame(head + body, First, FRAME_MAX)
        return first

    async def _request(self, reader: asyncio.StreamReader, decoder: FrameDecoder[Want]) -> Want | None:
        """The next ``Want``, or None when the peer hung up or went idle between requests."""
        deadline = time.monotonic() + IDLE_S
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            data = await asyncio.wait_for(reader.read(FRAME_MAX), left)
            if not data:
                return None
            wants = decoder.feed(data)
            if wants:
                if len(wants) > 1 or decoder.buffered:
                    raise DecodeError("a second request before the first was answered")
                return wants[0]

    async def _answer(self, writer: asyncio.StreamWriter, peer: str, want: Want) -> None:
        try:
            fd = open_range(self.locate, want)
        except RangeRefused as exc:
            writer.write(encode_frame(Refused(message=str(exc)), FRAME_MAX))
            await asyncio.wait_for(writer.drain(), STALL_S)
            return
        try:
            writer.write(encode_frame(Sending(offset=want.offset, length=want.length), FRAME_MAX))
            at, end = want.offset, want.offset + want.length
            while at < end:
                data = await read_chunk(fd, at, min(CHUNK, end - at))
                if self.pace is not None:
                    await self.pace(len(data))
                await self.send(writer, data)
                at += len(data)
                self.sent[peer] = self.sent.get(peer, 0) + len(data)
        finally:
            os.close(fd)

    async def send(self, writer: asyncio.StreamWriter, data: bytes) -> None:
        """Write one chunk; a peer that does not take it within ``STALL_S`` is cut off."""
        writer.write(data)
        await asyncio.wait_for(writer.drain(), STALL_S)


# -- the dialer ---------------------------------------------------------------------------------


class BulkClient:
    """Dials peers' bulk channels and keeps a few idle connections per peer for the next request."""

    def __init__(self, signing_key: SigningKey) -> None:
        _, self._ssl = tcp_tls.contexts(signing_key)
        self._idle: dict[str, list[tuple[asyncio.StreamReader, asyncio.StreamWriter, float]]] = {}
        self.received: dict[str, int] = {}
        """Bytes received per peer (node id), for status and tests."""
        self._worked: set[str] = set()
        """Peers whose channel has answered a request: a later failure is the peer's (it died, hung or
        restarted), not the path's, so it drops the holder instead of retrying the same range over QUIC."""

    async def get_range(self, node_id: str, host: str, port: int, model: str, offset: int, length: int) -> bytes:
        """Bytes ``[offset, offset + length)`` of ``model`` from ``node_id``.

        Raises :class:`BulkUnavailable` when the channel does not work (the caller falls back to
        QUIC), :class:`TransferFailed` when the peer refused or broke the protocol, or its channel
        failed after it had worked.
        """
        try:
            reader, writer = await self._connection(node_id, host, port)
        except BulkUnavailable as exc:
            raise self._failure(node_id, exc) from None
        want = Want(model=model, offset=offset, length=length)
        parser = ReplyParser(want)
        try:
            writer.write(encode_frame(want, FRAME_MAX))
            while not parser.done:
                data = await asyncio.wait_for(reader.read(CHUNK), STALL_S)
                if not data:
                    raise BulkUnavailable(f"node {short(node_id)} closed the bulk channel mid-reply")
                parser.feed(data)
        except DecodeError as exc:
            writer.close()
            raise TransferFailed(f"node {short(node_id)} broke the bulk protocol: {exc}") from None
        except BulkUnavailable as exc:
            writer.close()
            raise self._failure(node_id, exc) from None
        except (OSError, TimeoutError) as exc:
            writer.close()
            failed = BulkUnavailable(f"bulk channel to {short(node_id)} failed: {exc or 'timed out'}")
            raise self._failure(node_id, failed) from None
        except BaseException:
            writer.close()
            raise
        if parser.refused is not None:
            writer.close()
            raise TransferFailed(f"node {short(node_id)} refused: {parser.refused}")
        self._keep(node_id, reader, writer)
        self.received[node_id] = self.received.get(node_id, 0) + length
        self._worked.add(node_id)
        return bytes(parser.data)

    def _failure(self, node_id: str, exc: BulkUnavailable) -> BulkUnavailable | TransferFailed:
        """What a failed request raises: the path may be at fault (fall back to QUIC) until the channel
        to this peer has worked once; from then on the peer is (drop it for this transfer)."""
        if node_id in self._worked:
            return TransferFailed(f"node {short(node_id)} stopped answering: {exc}")
        return exc

    async def _connection(self, node_id: str, host: str, port: int) -> tuple[asyncio.StreamReader,
                                                                               asyncio.StreamWriter]:
        now = time.monotonic()
        idle = self._idle.get(node_id, [])
        while idle:
            reader, writer, since = idle.pop()
            if now - since < KEEP_S and not reader.at_eof() and not writer.is_closing():
                return reader, writer
            writer.close()
        try:
            reader, writer = await asyncio.wait_for(
                asyncio.open_connection(host, port, ssl=self._ssl, ssl_handshake_timeout=HANDSHAKE_S,
                                        limit=2 * CHUNK),
                CONNECT_S + HANDSHAKE_S)
        except (OSError, TimeoutError) as exc:
            raise BulkUnavailable(f"cannot reach the bulk channel of {short(node_id)} at {host}:{port}: "
                                  f"{exc or 'timed out'}") from None
        try:
            tcp_tls.check_peer(writer.get_extra_info("ssl_object"), node_id)
        except MeshllmError:
            writer.close()
            raise
        return reader, writer

    def _keep(self, node_id: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        idle = self._idle.setdefault(node_id, [])
        if len(idle) < KEEP_PER_PEER:
            idle.append((reader, writer, time.monotonic()))
        else:
            writer.close()

    def close(self) -> None:
        for idle in self._idle.values():
            for _, writer, _ in idle:
                writer.close()
        self._idle.clear()
