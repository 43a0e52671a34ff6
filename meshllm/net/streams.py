"""Typed bidirectional streams with bounded buffering in both directions.

A stream carries frames (``u32 length + msgpack``, :mod:`meshllm.wire.frames`); its first frame
names its kind (:class:`~meshllm.net.messages.StreamOpen`). Both directions are bounded:

* sending: :meth:`Stream.send` waits while more than ``send_budget`` bytes written to the stream
  are still unsent by aioquic (whose own writer never blocks); :meth:`Stream.drain` waits until
  all of it went out, so a caller can give up on (and reset) a peer that stops reading.
* receiving: the peer may send at most ``window`` bytes beyond what we have *consumed* (see
  :mod:`meshllm.net.quic`), so a slow reader stalls the peer's sender instead of growing our
  buffers. Complete-but-unread frames, an incoming stream's unparsed header and a partial frame
  all hold credit back. A frame longer than half a window could then never arrive, so such a
  frame first *reserves* its whole size from its connection's frame budget
  (:meth:`~meshllm.net.connection.PeerConnection.reserve`), and holds the reservation until the
  frame has been read; its bytes then count as consumed. Reservations are all-or-nothing and
  first come, first served, so two large frames can never deadlock each other half-way. However
  many streams its peer opens, a connection holds at most its frame budget of large frames
  (partial or unread) plus its connection window of everything else.

Deadlines bound whole operations, not wake-ups: ``recv`` and ``send`` have one deadline for the
call, and the connection's sweep (:meth:`Stream.overdue`) resets an incoming stream whose header
takes longer than :data:`HEADER_DEADLINE_S`, whose small frame makes less than
:data:`PROGRESS_BYTES` of progress in :data:`FRAME_DEADLINE_S`, or whose large (reserved) frame
takes longer than :data:`FRAME_DEADLINE_S` plus one second per :data:`FRAME_MIN_RATE` bytes, so a
peer dripping a byte a second cannot hold a stream, or the room behind it, while an honest peer on
a congested path that keeps making progress is left alone.

A malformed or oversized frame from the peer resets this stream only; the connection survives.
Everything a reset stream buffered is released at once.
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
HEADER_DEADLINE_S = 5.0
"""An incoming stream must deliver its kind header within this long."""
FRAME_DEADLINE_S = 5.0
"""A frame that has started arriving must end within this long, plus the size allowance below."""
FRAME_MIN_RATE = 1024 * 1024
"""Bytes per second a large frame is allowed at the slowest (a 32 MiB frame gets 5 + 32 s)."""
PROGRESS_BYTES = 1024
"""A small frame's clock restarts on each this many bytes of progress (a drip never gets there)."""


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
        self._window = peer.quic.stream_window
        self._decoder: FrameDecoder[msgspec.Raw] | None = None if kind is None else self._new_decoder()
        self._head = bytearray()
        self.held_kind: str | None = None
        """The kind an incoming stream's header named while no handler served it yet (:meth:`hold`)."""
        self._inbox: deque[tuple[msgspec.Raw, int]] = deque()
        """Complete unread frames, each with the bytes reserved for it (0 for a small one)."""
        self._inbox_bytes = 0
        self._inbox_reserved = 0
        self._received = 0
        self._ended = False
        self._fin_sent = False
        self._written = 0
        self._error: StreamClosed | None = None
        self._send_error: StreamClosed | None = None
        """Set when the peer stopped reading (STOP_SENDING): sends fail, reads go on."""
        self._readable = asyncio.Event()
        self._writable = asyncio.Event()
        self._writable.set()
        self._opened_at = peer.now()
        self._partial_reserved = 0
        """Bytes of the connection's frame budget held for the partial frame (0: none)."""
        self.awaiting_reservation = False
        self._frame_no = -1
        """``decoder.completed`` when the partial frame being timed began (-1: none)."""
        self._frame_clock: float | None = None
        self._progress = 0
        """Bytes of the current small frame since its clock last (re)started."""
        self._sized = False
        """The partial frame's length prefix has been seen (and a reservation asked for if needed)."""
        self._deferred = 0
        """Size of a large partial frame still waiting for this stream's earlier large frame to be read."""
        self._discarded = False

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
        :class:`StreamClosed` if the stream or connection ends, :class:`NetTimeout` when the
        whole call takes longer than ``timeout``.
        """
        data = encode_frame(message, self.max_frame)
        deadline = self._deadline(timeout)
        while True:
            self._check_writable()
            if self.queued <= self.send_budget:
                break
            self._writable.clear()
            self.peer.watch_sending(self)
            await self._wait(self._writable, deadline, timeout, "send")
        self._write(data)

    async def drain(self, timeout: float | None = DEFAULT_TIMEOUT) -> None:
        """Wait until everything written has gone out (a peer that stops reading never lets it)."""
        deadline = self._deadline(timeout)
        while self.queued > 0:
            if self._error is not None:
                raise self._error
            if self._send_error is not None:
                raise self._send_error
            self._writable.clear()
            self.peer.watch_sending(self, until_empty=True)
            await self._wait(self._writable, deadline, timeout, "drain")

    async def recv(self, type_: type[T] | Any, timeout: float | None = DEFAULT_TIMEOUT) -> T | None:
        """The next message decoded as ``type_``, or None when the peer ended the stream cleanly.

        A frame that does not decode as ``type_`` resets the stream and raises
        :class:`StreamClosed`; so does a reset by the peer or the connection closing.
        :class:`NetTimeout` when no whole frame arrived within ``timeout`` (for the call, however
        many bytes trickle in meanwhile).
        """
        deadline = self._deadline(timeout)
        while not self._inbox:
            if self._error is not None:
                raise self._error
            if self._ended:
                self.peer.forget_if_finished(self)
                return None
            self._readable.clear()
            await self._wait(self._readable, deadline, timeout, "recv")
        raw, reserved = self._inbox.popleft()
        self._inbox_bytes -= len(raw) + HEADER.size
        if reserved:
            self._inbox_reserved -= reserved
            self.peer.unreserve(reserved)
            self._request_reservation()
        if not self._inbox and self._frame_clock is not None:
            self._frame_clock = self.peer.now()  # the next frame waited on us, not on the peer
        self._grant_credit()
        if not self._inbox and self._ended:
            self.peer.forget_if_finished(self)  # the last frame of a stream we already closed: both sides done
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

    def discard_input(self) -> None:
        """We will read no more: ask the peer to stop sending and drop what it sent (STOP_SENDING)."""
        if self._ended or self._error is not None:
            return
        self._ended = self._discarded = True
        self._drop_input()
        self.peer.stream_op(lambda q: q.stop_stream(self.id, ResetCode.CANCELLED))
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
        if self._error is not None or self._discarded:
            return
        self._received += len(data)
        self.peer.endpoint.traffic.add_received(self.kind, len(data))
        self._progress += len(data)
        if self._frame_clock is not None and not self._partial_reserved and self._progress >= PROGRESS_BYTES:
            self._frame_clock, self._progress = self.peer.now(), 0  # a small frame moving along
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

    def hold(self, kind: str) -> None:
        """Incoming stream: its header named ``kind``, which no handler serves yet (the node is starting).
        Later bytes wait unread, and no header deadline applies: the wait for a handler has its own."""
        self.held_kind = kind

    def bind(self, kind: str, max_frame: int) -> None:
        """Incoming stream: its kind is known; decode what followed the header, capped by ``max_frame``."""
        self.kind = kind
        self.peer.endpoint.traffic.name_received(kind, self._received)
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
        """The peer reset its direction (RESET_STREAM): nothing more will be read from it."""
        if self._error is None:
            self._error = StreamClosed(f"stream {self.kind} #{self.id} {why}")
            self._drop_input()
            self._wake()

    def on_stop_sending(self, why: str) -> None:
        """The peer asked us to stop sending (STOP_SENDING); what it already sent can still be read."""
        if self._send_error is None:
            self._send_error = StreamClosed(f"stream {self.kind} #{self.id} {why}")
            self._writable.set()

    def on_connection_closed(self, reason: str) -> None:
        if self._error is None and not (self._ended and self._fin_sent):
            self._error = StreamClosed(f"connection closed: {reason}")
        self._drop_input()
        self._wake()

    def on_transmitted(self, until_empty: bool = False) -> bool:
        """aioquic sent data: wake a blocked sender if the budget allows. True once unblocked."""
        if self._error is not None or self._send_error is not None \
                or self.queued <= (0 if until_empty else self.send_budget):
            self._writable.set()
            return True
        return False

    @property
    def reserved(self) -> int:
        """Bytes of the connection's frame budget this stream holds (its partial and unread large frames)."""
        return self._partial_reserved + self._inbox_reserved

    def on_reserved(self, size: int) -> None:
        """The connection granted the reservation this stream asked for: its frame may flow now."""
        self.awaiting_reservation = False
        if self._error is not None or self._discarded:
            self.peer.unreserve(size)
            return
        self._partial_reserved = size
        self._frame_clock = self.peer.now()
        self._grant_credit()

    def overdue(self, now: float) -> str | None:
        """Why this stream should be reset now (a header or a frame taking too long), or None."""
        if self._error is not None:
            return None
        if self._decoder is None and self.held_kind is None and not self._ended \
                and now - self._opened_at > HEADER_DEADLINE_S:
            return f"no stream header within {HEADER_DEADLINE_S:.0f} s"
        if self._frame_clock is None or self._inbox or self.awaiting_reservation or self._deferred:
            return None
        size = self._decoder.pending_size() if self._decoder is not None else None
        allowed = FRAME_DEADLINE_S + (size or 0) / FRAME_MIN_RATE if self._partial_reserved else FRAME_DEADLINE_S
        if now - self._frame_clock > allowed:
            return f"a frame of {size if size is not None else '?'} bytes did not arrive within {allowed:.0f} s"
        return None

    def forgive(self, seconds: float) -> None:
        """Our own loop stalled for ``seconds``: that time does not count against the peer."""
        if self._frame_clock is not None:
            self._frame_clock += seconds
        self._opened_at += seconds

    @property
    def blocked_by_peer(self) -> bool:
        """Unsent data waits for the peer's credit (it is not reading), not for the network."""
        return self.queued > 0 and self.peer.quic.credit_blocked(self.id)

    @property
    def buffered(self) -> int:
        """Every received byte this stream still holds: header, partial frame and unread frames."""
        return len(self._head) + self._inbox_bytes + (self._decoder.buffered if self._decoder else 0)

    @property
    def finished(self) -> bool:
        """Both directions are over (the connection may forget the stream)."""
        sent = self._fin_sent or self._send_error is not None
        return self._error is not None or (self._ended and sent and not self._inbox)

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
        self._track_partial()

    def _track_partial(self) -> None:
        """Time each frame from its first byte, and reserve room for a large one once its length
        is known; release both when it ends."""
        assert self._decoder is not None
        decoder = self._decoder
        partial = decoder.buffered > 0
        if self._frame_no != -1 and (not partial or decoder.completed != self._frame_no):
            self._frame_no, self._frame_clock, self._sized, self._deferred = -1, None, False, 0
        if not partial:
            return
        if self._frame_no == -1:
            self._frame_no, self._frame_clock, self._progress = decoder.completed, self.peer.now(), 0
        if not self._sized and (size := decoder.pending_size()) is not None:
            self._sized = True
            if size > self._window // 2:
                self._deferred = size
                self._request_reservation()

    def _request_reservation(self) -> None:
        """Ask for room for the deferred large frame, once no earlier large frame waits to be read
        (a stream holds at most one, so a slow reader slows its sender)."""
        size = self._deferred
        if not size or self._inbox_reserved:
            return
        self._deferred = 0
        if self.peer.reserve(self, size):
            self._partial_reserved = size
            self._frame_clock = self.peer.now()
            self._grant_credit()
        else:
            self.awaiting_reservation = True

    def _push(self, frames: list[msgspec.Raw]) -> None:
        for raw in frames:
            # The first frame completed is the one that was partial: its reservation moves with it.
            reserved, self._partial_reserved = self._partial_reserved, 0
            self._inbox.append((raw, reserved))
            self._inbox_bytes += len(raw) + HEADER.size
            self._inbox_reserved += reserved

    def send_nowait(self, message: Any) -> None:
        """Write one small control frame without waiting for budget (admission exchange)."""
        self._check_writable()
        self._write(encode_frame(message, self.max_frame))

    def _held(self) -> int:
        """Received bytes that still hold back credit: unread frames, an unparsed header, and a
        partial frame unless the connection reserved room for all of it."""
        partial = self._decoder.buffered if self._decoder is not None and not self._partial_reserved else 0
        return len(self._head) + self._inbox_bytes - self._inbox_reserved + partial

    def _grant_credit(self) -> None:
        if self._error is None and self.peer.quic.consume(self.id, self._received - self._held()):
            self.peer.transmit_soon()

    def _write(self, data: bytes) -> None:
        self._written += len(data)
        self.peer.endpoint.traffic.add_sent(self.kind, len(data))
        self.peer.stream_op(lambda q: q.send_stream_data(self.id, data))

    def _check_writable(self) -> None:
        if self._error is not None:
            raise self._error
        if self._send_error is not None:
            raise self._send_error
        if self._fin_sent:
            raise StreamClosed(f"stream {self.kind} #{self.id} was closed for sending")

    def _drop_input(self) -> None:
        """Release everything received and not read (the stream will deliver nothing more)."""
        self._inbox.clear()
        self._inbox_bytes = 0
        self._head = bytearray()
        if self._decoder is not None:
            self._decoder.clear()
        self._frame_clock, self._frame_no, self._sized, self._deferred = None, -1, False, 0
        if self.reserved:
            self.peer.unreserve(self.reserved)
            self._partial_reserved = self._inbox_reserved = 0
        if self.awaiting_reservation:
            self.awaiting_reservation = False
            self.peer.cancel_reservation(self)

    def _fail(self, code: ResetCode, why: str) -> None:
        if code is not ResetCode.CANCELLED:
            log.warning("resetting %r: %s", self, why)
        self._error = StreamClosed(f"stream {self.kind} #{self.id} reset: {why}")
        self._drop_input()
        self.peer.stream_op(lambda q: q.reset_stream(self.id, code))
        if not self._ended:
            self.peer.stream_op(lambda q: q.stop_stream(self.id, code))
        self._wake()

    def _wake(self) -> None:
        self._readable.set()
        self._writable.set()

    def _deadline(self, timeout: float | None) -> float | None:
        return None if timeout is None else asyncio.get_running_loop().time() + timeout

    async def _wait(self, event: asyncio.Event, deadline: float | None, timeout: float | None, what: str) -> None:
        # asyncio.timeout_at, not wait_for: wait_for runs event.wait() as a separate task, which
        # costs extra event-loop turns on every wake-up of a latency-sensitive stream.
        try:
            async with asyncio.timeout_at(deadline):
                await event.wait()
        except TimeoutError:
            raise NetTimeout(f"{what} on stream {self.kind} #{self.id} timed out after {timeout}s") from None
