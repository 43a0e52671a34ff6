"""Typed bidirectional streams with bounded buffering in both directions.

A stream carries frames (``u32 length + msgpack``, :mod:`meshllm.wire.frames`); its first frame
names its kind (:class:`~meshllm.net.messages.StreamOpen`). Both directions are bounded:

* sending: :meth:`Stream.send` waits while more than ``send_budget`` bytes written to the stream
  are still unsent by aioquic (whose own writer never blocks);
* receiving: the peer may send at most ``window`` bytes beyond what we have *consumed* (see
  :mod:`meshllm.net.quic`), so a slow reader stalls the peer's sender instead of growing our
  buffers. Bytes count as consumed once they are read by :meth:`Stream.recv` *or* sit in the
  decoder as part of a frame that is not complete yet: holding back credit for a partial frame
  would freeze any frame at least a window long. Only complete-but-unread frames (and an
  incoming stream's unparsed header) hold credit back, so one stream buffers at most about
  ``max_frame + window`` bytes.

A malformed or oversized frame from the peer resets this stream only; the connection survives.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from typing import TYPE_CHECKING, Any, TypeVar

import msgspec

from meshllm.errors import DecodeError
from meshllm.identity.ids import short
from meshllm.net.errors import NetTimeout, StreamClosed
from meshllm.net.messages import HEADER_FRAME_MAX, ResetCode, StreamOpen
from meshllm.wire.frames import HEADER, FrameDecoder, decode_frame, encode_frame

if TYPE_CHECKING:
    from meshllm.net.connection import PeerConnection

log = logging.getLogger(__name__)
T = TypeVar("T")

SEND_BUDGET = 1024 * 1024
"""Default bytes a stream may hold unsent before :meth:`Stream.send` waits."""
DEFAULT_TIMEOUT = 30.0


class Stream:
    """One bidirectional QUIC stream of typed frames between us and ``peer``."""

    def __init__(
        self, peer: PeerConnection, stream_id: int, *, kind: str | None, max_frame: int, send_budget: int
    ) -> None:
        self.peer = peer
        self.id = stream_id
        self.kind = kind
        """The stream's kind; None on an incoming stream until its header frame has arrived."""
        self.max_frame = max_frame
        self.send_budget = send_budget
        self._decoder: FrameDecoder[msgspec.Raw] | None = None if kind is None else self._new_decoder()
        self._head = bytearray()
        self._inbox: deque[msgspec.Raw] = deque()
        self._inbox_bytes = 0
        self._received = 0
        self._ended = False
        self._fin_sent = False
        self._written = 0
        self._error: StreamClosed | None = None
        self._readable = asyncio.Event()
        self._writable = asyncio.Event()
        self._writable.set()

    def __repr__(self) -> str:
        return f"<Stream {self.kind} #{self.id} with {short(self.peer.node_id or '?')}>"

    # -- public API ---------------------------------------------------------------------------

    @property
    def queued(self) -> int:
        """Bytes written to this stream that aioquic has not sent yet."""
        return self.peer.quic.unsent_bytes(self.id, self._written)

    async def send(self, message: Any, timeout: float | None = DEFAULT_TIMEOUT) -> None:
        """Queue one message (a msgspec struct or anything msgpack-able) as a frame.

        Waits while the stream's unsent bytes exceed ``send_budget``; raises
        :class:`StreamClosed` if the stream or connection ends, :class:`NetTimeout` on deadline.
        """
        data = encode_frame(message, self.max_frame)
        while True:
            self._check_writable()
            if self.queued <= self.send_budget:
                break
            self._writable.clear()
            self.peer.watch_sending(self)
            await self._wait(self._writable, timeout, "send")
        self._write(data)

    async def recv(self, type_: type[T] | Any, timeout: float | None = DEFAULT_TIMEOUT) -> T | None:
        """The next message decoded as ``type_``, or None when the peer ended the stream cleanly.

        A frame that does not decode as ``type_`` resets the stream and raises
        :class:`StreamClosed`; so does a reset by the peer or the connection closing.
        """
        while not self._inbox:
            if self._error is not None:
                raise self._error
            if self._ended:
                self.peer.forget_if_finished(self)
                return None
            self._readable.clear()
            await self._wait(self._readable, timeout, "recv")
        raw = self._inbox.popleft()
        self._inbox_bytes -= len(raw) + HEADER.size
        self._grant_credit()
        try:
            return msgspec.msgpack.decode(raw, type=type_)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            self._fail(ResetCode.BAD_FRAME, f"frame is not a valid {getattr(type_, '__name__', type_)}: {exc}")
            raise self._error from exc  # type: ignore[misc]

    def close(self) -> None:
        """End our direction cleanly (the peer's ``recv`` returns None after the last frame)."""
        if self._fin_sent or self._error is not None:
            return
        self._fin_sent = True
        self.peer.stream_op(lambda q: q.send_stream_data(self.id, b"", end_stream=True))
        self.peer.forget_if_finished(self)

    def reset(self, code: ResetCode = ResetCode.CANCELLED) -> None:
        """Abort both directions; pending data is dropped and the peer sees a reset."""
        if self._error is None:
            self._fail(code, "reset locally")
        self.peer.forget_if_finished(self)

    # -- driver hooks (called by PeerConnection) -------------------------------------------

    def open(self) -> None:
        """Outgoing stream: send the header naming its kind."""
        self._write(encode_frame(StreamOpen(kind=self.kind or ""), HEADER_FRAME_MAX))

    def feed(self, data: bytes, end: bool) -> None:
        """Bytes arrived from aioquic, in order; ``end`` when the peer finished its direction."""
        if self._error is not None:
            return
        self._received += len(data)
        if self._decoder is None:
            self._head += data
            self._ended = self._ended or end
        else:
            self._ingest(data, end)
            self._grant_credit()
        self._readable.set()

    def take_header(self) -> StreamOpen | None:
        """Incoming stream: the kind header once complete (None until then); DecodeError if bad."""
        if len(self._head) < HEADER.size:
            return None
        (length,) = HEADER.unpack_from(self._head)
        if length > HEADER_FRAME_MAX:
            raise DecodeError(f"stream header of {length} bytes exceeds {HEADER_FRAME_MAX}")
        end = HEADER.size + length
        if len(self._head) < end:
            return None
        header = decode_frame(bytes(self._head[:end]), StreamOpen, HEADER_FRAME_MAX)
        del self._head[:end]
        return header

    def bind(self, kind: str, max_frame: int) -> None:
        """Incoming stream: its kind is known; decode what followed the header, capped by ``max_frame``."""
        self.kind = kind
        self.max_frame = max_frame
        self._decoder = self._new_decoder()
        rest = bytes(self._head)
        self._head.clear()
        self._ingest(rest, self._ended)
        self._grant_credit()

    @property
    def ended(self) -> bool:
        """The peer finished its direction (FIN)."""
        return self._ended

    def on_reset(self, why: str) -> None:
        """The peer reset its direction (RESET_STREAM) or asked us to stop (STOP_SENDING)."""
        if self._error is None:
            self._error = StreamClosed(f"stream {self.kind} #{self.id} {why}")
            self._wake()

    def on_connection_closed(self, reason: str) -> None:
        if self._error is None and not (self._ended and self._fin_sent):
            self._error = StreamClosed(f"connection closed: {reason}")
        self._wake()

    def on_transmitted(self) -> bool:
        """aioquic sent data: wake a blocked sender if the budget allows. True once unblocked."""
        if self._error is not None or self.queued <= self.send_budget:
            self._writable.set()
            return True
        return False

    @property
    def finished(self) -> bool:
        """Both directions are over (the connection may forget the stream)."""
        return self._error is not None or (self._ended and self._fin_sent and not self._inbox)

    def fail(self, code: ResetCode, why: str) -> None:
        """Reset the stream because of something the peer did (logged)."""
        self._fail(code, why)

    # -- internals ----------------------------------------------------------------------------

    def _new_decoder(self) -> FrameDecoder[msgspec.Raw]:
        return FrameDecoder(msgspec.Raw, self.max_frame)

    def _ingest(self, data: bytes, end: bool) -> None:
        assert self._decoder is not None
        try:
            self._push(self._decoder.feed(data))
            if end and not self._decoder.at_boundary():
                raise DecodeError("stream ended inside a frame")
        except DecodeError as exc:
            self._fail(ResetCode.BAD_FRAME, str(exc))
            return
        self._ended = self._ended or end

    def _push(self, frames: list[msgspec.Raw]) -> None:
        for raw in frames:
            self._inbox.append(raw)
            self._inbox_bytes += len(raw) + HEADER.size

    def send_nowait(self, message: Any) -> None:
        """Write one small control frame without waiting for budget (admission exchange)."""
        self._check_writable()
        self._write(encode_frame(message, self.max_frame))

    def _unconsumed(self) -> int:
        """Received bytes that still hold back credit: complete unread frames and an unparsed header.

        A partial frame in the decoder does not count (see the module docstring): the decoder's
        own ``max_frame`` cap bounds it, and its sender needs credit to complete it.
        """
        return len(self._head) + self._inbox_bytes

    def _buffered(self) -> int:
        """Every received byte we still hold: header, partial frame, and unread frames."""
        return self._unconsumed() + (self._decoder.buffered if self._decoder else 0)

    def _grant_credit(self) -> None:
        if self._error is None and self.peer.quic.consume(self.id, self._received - self._unconsumed()):
            self.peer.transmit_soon()

    def _write(self, data: bytes) -> None:
        self._written += len(data)
        self.peer.stream_op(lambda q: q.send_stream_data(self.id, data))

    def _check_writable(self) -> None:
        if self._error is not None:
            raise self._error
        if self._fin_sent:
            raise StreamClosed(f"stream {self.kind} #{self.id} was closed for sending")

    def _fail(self, code: ResetCode, why: str) -> None:
        if code is not ResetCode.CANCELLED:
            log.warning("resetting %r: %s", self, why)
        self._error = StreamClosed(f"stream {self.kind} #{self.id} reset: {why}")
        self._inbox.clear()
        self._inbox_bytes = 0
        self.peer.stream_op(lambda q: q.reset_stream(self.id, code))
        if not self._ended:
            self.peer.stream_op(lambda q: q.stop_stream(self.id, code))
        self._wake()

    def _wake(self) -> None:
        self._readable.set()
        self._writable.set()

    async def _wait(self, event: asyncio.Event, timeout: float | None, what: str) -> None:
        # asyncio.timeout, not wait_for: wait_for runs event.wait() as a separate task, which
        # costs extra event-loop turns on every wake-up of a latency-sensitive stream.
        try:
            async with asyncio.timeout(timeout):
                await event.wait()
        except TimeoutError:
            raise NetTimeout(f"{what} on stream {self.kind} #{self.id} timed out after {timeout}s") from None
