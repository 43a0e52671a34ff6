"""Stage lanes over the bulk channel (TLS on TCP, node keys): prompt activations at link speed.

Why: a prompt's activations are megabytes per hop (2,048 tokens of a 640-wide model: 5.2 MB in
f32), and aioquic spends about 0.24 s of Python per MB between its two ends (docs/architecture.md),
which on a loaded host puts prefill through a chain well behind the same prompt on one node. TLS
over TCP costs about 0.005 s per MB. So a lane to a peer that offers a bulk channel, over a QUIC
path that is direct, is a TLS connection to that channel; the QUIC connection to the peer stays
(liveness probes, peer events, everything else). Through relays and punched paths, with no bulk
port, or while a dial to it failed recently, the lane is a QUIC stream as before. Decode frames ride
the same lane: one ordered byte stream per pair of nodes, as on QUIC, so Open, prompt chunks and
steps keep their order.

**Protocol**: the dialer connects to the peer's bulk port (``models/bulk.py``: the listener serves
only admitted peers, the dialer checks the listener's certificate against the node id it dialled),
sends one :class:`~meshllm.models.bulk.OpenLane` frame and waits for the listener to echo it (a
listener that refuses the peer closes the connection instead: the lane then rides QUIC), then lane
frames flow both ways in the wire framing (4-byte length, msgpack body) exactly as on a QUIC stream.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import msgspec
from nacl.signing import SigningKey

from meshllm.errors import DecodeError, MeshllmError
from meshllm.identity.ids import short
from meshllm.models.bulk import CONNECT_S, FRAME_MAX, HANDSHAKE_S, OpenLane
from meshllm.net import tcp_tls
from meshllm.net.errors import NetTimeout, StreamClosed
from meshllm.net.traffic import StreamTraffic
from meshllm.split.frames import KIND, LANE_FRAME_MAX
from meshllm.wire.frames import FrameDecoder, decode_frame, encode_frame

log = logging.getLogger(__name__)

READ = 1 << 20
"""Bytes read from the socket at a time."""
QUIC_ONLY_S = 60.0
"""A peer whose lane dial failed gets QUIC lanes for this long before its bulk channel is tried again."""


class TcpStream:
    """The part of :class:`~meshllm.net.Stream` a :class:`~meshllm.split.lanes.Lane` uses, on a TLS connection."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                 max_frame: int = LANE_FRAME_MAX, traffic: StreamTraffic | None = None) -> None:
        self._reader = reader
        self._writer = writer
        self.max_frame = max_frame
        self._traffic = traffic
        """The endpoint's totals (``/metrics``), counted under the kind a QUIC lane has: the same bytes
        whichever transport carries them."""
        self._decoder: FrameDecoder[msgspec.Raw] = FrameDecoder(msgspec.Raw, max_frame)
        self._inbox: deque[msgspec.Raw] = deque()

    async def send(self, message: Any, timeout: float | None = None) -> None:
        """Write one frame; :class:`StreamClosed` if the connection is gone, :class:`NetTimeout` if the
        peer does not take it within ``timeout``."""
        if self._writer.is_closing():
            raise StreamClosed("the lane's TCP connection is closed")
        frame = encode_frame(message, self.max_frame)
        self._writer.write(frame)
        if self._traffic is not None:
            self._traffic.add_sent(KIND, len(frame))
        try:
            await asyncio.wait_for(self._writer.drain(), timeout)
        except TimeoutError:
            raise NetTimeout(f"lane send stalled for {timeout} s") from None
        except (OSError, RuntimeError) as exc:  # (RuntimeError: drain on a transport closed meanwhile)
            raise StreamClosed(f"lane connection failed: {exc}") from None

    async def recv(self, type_: Any, timeout: float | None = None) -> Any:
        """The next frame decoded as ``type_``; None when the peer closed the connection cleanly."""
        while not self._inbox:
            try:
                data = await asyncio.wait_for(self._reader.read(READ), timeout)
            except TimeoutError:
                raise NetTimeout(f"no lane frame for {timeout} s") from None
            except OSError as exc:
                raise StreamClosed(f"lane connection failed: {exc}") from None
            if not data:
                if not self._decoder.at_boundary():
                    raise StreamClosed("lane connection ended mid-frame")
                return None
            if self._traffic is not None:
                self._traffic.add_received(KIND, len(data))
            try:
                self._inbox.extend(self._decoder.feed(data))
            except DecodeError as exc:
                self.reset()
                raise StreamClosed(f"bad lane framing: {exc}") from None
        raw = self._inbox.popleft()
        if type_ is msgspec.Raw:
            return raw
        try:
            return msgspec.msgpack.decode(raw, type=type_)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            self.reset()
            raise StreamClosed(f"frame is not a valid {getattr(type_, '__name__', type_)}: {exc}") from None

    def reset(self) -> None:
        """End the connection at once (both directions)."""
        self._writer.transport.abort()


class LaneDialer:
    """Opens TLS lanes to peers' bulk channels; remembers peers whose channel failed (QUIC for a while)."""

    def __init__(self, signing_key: SigningKey, bulk_port: Callable[[str], int],
                 traffic: StreamTraffic | None = None) -> None:
        _, self._ssl = tcp_tls.contexts(signing_key)
        self.bulk_port = bulk_port
        self._traffic = traffic
        self._quic_only: dict[str, float] = {}

    async def __call__(self, node_id: str, host: str) -> TcpStream | None:
        """A lane stream to ``node_id``'s bulk channel at ``host``, or None (the caller uses QUIC)."""
        port = self.bulk_port(node_id)
        if not port or self._quic_only.get(node_id, 0.0) > time.monotonic():
            return None
        writer: asyncio.StreamWriter | None = None
        try:
            reader, writer = await asyncio.wait_for(
                asyncio.open_connection(host, port, ssl=self._ssl, ssl_handshake_timeout=HANDSHAKE_S, limit=2 * READ),
                CONNECT_S + HANDSHAKE_S)
            tcp_tls.check_peer(writer.get_extra_info("ssl_object"), node_id)
            writer.write(encode_frame(OpenLane(), FRAME_MAX))
            # the listener checks admission and its connection limits after the handshake: its echo says
            # it took the lane (a refusal is a closed connection, and then the lane rides QUIC)
            echo = await asyncio.wait_for(reader.readexactly(len(encode_frame(OpenLane(), FRAME_MAX))), HANDSHAKE_S)
            decode_frame(echo, OpenLane, FRAME_MAX)
        except (OSError, TimeoutError, MeshllmError, asyncio.IncompleteReadError) as exc:
            if writer is not None:
                writer.transport.abort()
            log.warning("stage lane to %s over its bulk channel failed, using QUIC for %.0f s: %s",
                        short(node_id), QUIC_ONLY_S, exc or "timed out")
            self._quic_only[node_id] = time.monotonic() + QUIC_ONLY_S
            return None
        return TcpStream(reader, writer, traffic=self._traffic)
