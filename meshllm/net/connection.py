"""PeerConnection: the asyncio driver around one :class:`~meshllm.net.quic.MeshQuicConnection`.

It moves datagrams between the endpoint's socket and aioquic, runs the timers, checks the peer's
TLS identity when the handshake completes, runs the admission exchange (:mod:`.admission`),
routes stream data to :class:`~meshllm.net.streams.Stream` objects and incoming streams to the
handlers registered per kind, and drives the probes (:mod:`.probes`). Nothing here decides
policy: admission is the injected ``admit``; what a kind means is its handler's business.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Literal

from aioquic.quic import events as qe

from meshllm.errors import DecodeError, MeshllmError, VerificationError
from meshllm.identity.ids import short
from meshllm.net import tls
from meshllm.net.admission import Admission, Phase
from meshllm.net.errors import AdmissionRefused, ConnectError, PeerMismatch, StreamClosed
from meshllm.net.events import PeerEvent, PeerEventKind
from meshllm.net.messages import (
    ADMISSION_FRAME_MAX,
    Addr,
    AdmissionMessage,
    CloseCode,
    ResetCode,
    is_virtual,
    normalize_addr,
)
from meshllm.net.probes import Liveness, ProbeOutput, ProbeState, is_probe
from meshllm.net.quic import ALPN, MeshQuicConnection
from meshllm.net.streams import Stream
from meshllm.tasks import spawn
from meshllm.wire.frames import CONTROL_FRAME_MAX

if TYPE_CHECKING:
    from meshllm.net.endpoint import Endpoint

log = logging.getLogger(__name__)
PathType = Literal["direct", "punched", "relayed"]
RETIRE_GRACE_S = 1.0
"""A replaced relayed connection lives at least this long, so the peer can switch over too ..."""
RETIRE_MAX_S = 15.0
"""... and at most this long, while streams that were already running on it finish."""
ADMISSION_STREAM = 0
"""The dialer's first bidirectional stream carries the admission exchange."""
MAX_UNSEEN_PEER_STREAMS = 4096
"""Most peer stream ids below the highest seen that we still wait for (aioquic's stream limit
keeps the real number far lower; this only bounds memory against a misbehaving peer)."""
MAX_PENDING_DATAGRAMS = 16
"""Probe datagrams (pings and pongs) are dropped while this many are queued and unsent."""
EARLY_DATAGRAMS_MAX = 16
"""Datagrams a peer may send between our Welcome and its Confirm that we keep for once it is admitted."""
SWEEP_INTERVAL_S = 0.5
"""How often a connection checks its streams' header and frame deadlines."""


class PeerConnection:
    """One QUIC connection to one peer. Obtain it from :meth:`Endpoint.connect` or a handler."""

    def __init__(
        self, endpoint: Endpoint, quic: MeshQuicConnection, addr: Addr, *, dialer: bool, expected: str | None,
        handshake_s: float | None = None,
    ) -> None:
        """``handshake_s``: an incoming connection whose TLS handshake has not completed this long after
        its first packet is dropped without a word (None: it has the whole admission time)."""
        self.endpoint = endpoint
        self.quic = quic
        self.dialer = dialer
        """True when we dialed this connection."""
        self.remote_addr: Addr = addr
        """Where we see the peer (the UDP source of its packets)."""
        self.path: PathType = "relayed" if is_virtual(addr) else "direct"
        """How packets travel: straight over UDP, over UDP through a punched NAT, or via a relay."""
        self.observed_addr: Addr | None = None
        """Where the peer sees *us*, as it told us during admission (for NAT traversal)."""
        self.node_id: str | None = None
        """The peer's node id, proven by its TLS certificate (None until the handshake ends)."""
        self.close_reason: str | None = None
        """Why the connection ended, once it has."""
        self.probes: ProbeState | None = None
        self._expected = expected
        self._loop = asyncio.get_running_loop()
        self.heard_at = self._loop.time()
        """Loop time of the last packet from the peer (a dead peer's connection is silent)."""
        self._admission: Admission | None = None
        self._streams: dict[int, Stream] = {}
        self._has_streams = asyncio.Event()
        """Set while streams are open: the sweep sleeps on it otherwise (an idle connection costs no wakeups)."""
        self._work = asyncio.Event()
        """Set when a stream of work opens (not a ``quiet_kinds`` one): quiet probing speeds up on it."""
        self._probing = False
        """Whether our probes run now (so their RTT is current)."""
        self._peer_next: dict[int, int] = {}
        """Per stream type (``id & 3``): the lowest peer stream id above every one seen so far."""
        self._peer_unseen: set[int] = set()
        """Peer stream ids below one already seen whose first data has not arrived yet (reordering)."""
        self._tasks: set[asyncio.Task[Any]] = set()
        self._sending_watch: dict[Stream, bool] = {}
        """Streams whose blocked sender waits for transmits (value: wait until nothing is unsent)."""
        self.pending_source: Addr | None = None
        """The source address an incoming connection counts against until it is admitted or gone."""
        self._ready: asyncio.Future[None] = self._loop.create_future()
        self._early: list[bytes] = []
        """Datagrams the peer sent before our admission finished (``EARLY_DATAGRAMS_MAX``), handed on after."""
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at: float | None = None
        self._transmit_handle: asyncio.Handle | None = None
        self._handshake_deadline: asyncio.TimerHandle | None = None
        # (a dial lives on past its caller's timeout, up to the acceptor's limit: Endpoint.connect)
        self._deadline: asyncio.TimerHandle | None = self._loop.call_later(
            endpoint.options.admission_timeout, self._overdue
        )
        if handshake_s is not None:
            self._handshake_deadline = self._loop.call_later(handshake_s, self.discard, "handshake timed out")

    def __repr__(self) -> str:
        return f"<PeerConnection {short(self.node_id or '?')} {self.remote_addr} {self.state}>"

    # -- public API ---------------------------------------------------------------------------

    @property
    def state(self) -> str:
        """``connecting``, ``alive``, ``suspect`` or ``closed``."""
        if self.close_reason is not None:
            return "closed"
        if not self.admitted:
            return "connecting"
        return self.probes.state.value if self.probes else Liveness.ALIVE.value

    @property
    def streams_open(self) -> int:
        """Streams on this connection that have not ended yet (either side's)."""
        return len(self._streams)

    @property
    def passive(self) -> bool:
        """The peer dialed us as a passive client: no gossip with it, and we answer its probes without sending any."""
        return self._admission is not None and self._admission.peer_passive

    @property
    def admitted(self) -> bool:
        return self._admission is not None and self._admission.phase is Phase.ADMITTED

    @property
    def rtt_ms(self) -> float | None:
        """Smoothed RTT in milliseconds: the datagram probes' while they run and have measured it, else
        QUIC's own (from the ACKs of what we sent: a member connection with no work is not probed, but its
        gossip and the failure detector's datagrams are acknowledged, so it stays current where the
        probes' last figure, taken under load, would not). None before admission."""
        if self.probes is None:
            return None
        if self._probing and self.probes.rtt_ms is not None:
            return self.probes.rtt_ms
        return self.quic.smoothed_rtt_ms()

    @property
    def path_rtt_ms(self) -> float | None:
        """The path's RTT in milliseconds, without the queueing and scheduling delays that a loaded host
        adds to every sample: QUIC's minimum RTT. What a node publishes as its distance to a peer: a
        smoothed RTT swings with load, and each swing out of the band re-signed and flooded a record,
        which loaded the host further (20 members on one host fed that loop until every core was busy)."""
        return self.quic.min_rtt_ms() if self.probes is not None else None

    async def open_stream(
        self, kind: str, *, max_frame: int = CONTROL_FRAME_MAX, send_budget: int | None = None
    ) -> Stream:
        """Open a bidirectional stream whose handler on the peer is the one registered for ``kind``.

        ``max_frame`` caps the frames we accept back on it.
        """
        if self.close_reason is not None:
            raise StreamClosed(f"connection to {short(self.node_id or '?')} is closed: {self.close_reason}")
        if not self.admitted:
            raise StreamClosed("connection is not admitted yet")
        stream_id = self.quic.get_next_available_stream_id()
        stream = self._add_stream(stream_id, kind, max_frame, send_budget)
        stream.open()
        return stream

    def close(self, reason: str = "closed", code: CloseCode = CloseCode.NORMAL) -> None:
        """Send CONNECTION_CLOSE with ``reason``; local streams and tasks end at once.

        What was already written goes out first: a reply sent just before closing (a listing, a
        refusal) must not be overtaken by the close, even when its transmit was deferred a loop turn.
        """
        if self.close_reason is not None:
            return
        self.transmit()
        self.quic.close(error_code=code, reason_phrase=reason)
        self.transmit()
        self._finish(reason, self._error_for(code, reason, local=True))

    def _overdue(self) -> None:
        """Admission did not finish within ``admission_timeout``: close; an incoming handshake that never
        completed is dropped without a word instead (its source address may be spoofed)."""
        if self.dialer:
            self.close("dial timed out", CloseCode.ADMISSION_TIMEOUT)
        elif self.node_id is None:
            self.discard("handshake timed out")
        else:
            self.close("admission timed out", CloseCode.ADMISSION_TIMEOUT)

    def discard(self, reason: str) -> None:
        """Forget a connection that never finished its handshake, sending nothing to its address."""
        if self.close_reason is not None:
            return
        self._finish(reason, ConnectError(f"connection from {self.remote_addr[0]} dropped: {reason}"))
        self.abandon()
        self.endpoint.forget(self)

    def strike(self, reason: str) -> None:
        """The peer overstepped a limit (the caller already dropped or reset what it sent)."""
        log.warning("peer %s (%s) overstepped a limit: %s", short(self.node_id or "?"), self.remote_addr, reason)
        self.endpoint.strike(self, reason)

    def now(self) -> float:
        """The loop clock streams time their deadlines with."""
        return self._loop.time()

    # -- frame budget: room for large partial frames (see budget.py) ----------------------------

    def reserve(self, stream: Stream, size: int) -> bool:
        """Reserve ``size`` bytes of room for ``stream``'s large frame: True now, False when queued
        (``stream.on_reserved(size)`` follows once granted). A frame no budget can hold resets its stream."""
        budget = self.endpoint.frames
        if not budget.fits(size):
            stream.fail(ResetCode.BAD_FRAME, f"a frame of {size} bytes exceeds the frame budget")
            self.strike("frame larger than the frame budget")
            return True
        return budget.reserve(self, stream, size)

    def cancel_reservation(self, stream: Stream) -> None:
        self.endpoint.frames.cancel(stream)

    def unreserve(self, size: int) -> None:
        """Give ``size`` reserved bytes back (their frame was read, or its stream ended)."""
        self.endpoint.frames.release(self, size)

    def retire(self, reason: str) -> None:
        """Close once our streams on this connection are done (another connection replaced it)."""
        spawn(self._tasks, self._retire(reason))

    async def _retire(self, reason: str) -> None:
        await asyncio.sleep(RETIRE_GRACE_S)
        end = self._loop.time() + RETIRE_MAX_S
        while self._streams and self._loop.time() < end and self.close_reason is None:
            await asyncio.sleep(0.25)
        self.close(reason, CloseCode.DUPLICATE)

    @property
    def silent_s(self) -> float:
        """Seconds since the peer's last packet of any kind (:attr:`heard_at`)."""
        return self._loop.time() - self.heard_at

    async def wait_admitted(self) -> None:
        """Return once admission finished both ways; raise the dial's typed error otherwise."""
        await asyncio.shield(self._ready)

    # -- driver: I/O and timers ---------------------------------------------------------------

    def datagram_received(self, data: bytes, addr: Addr) -> None:
        self.remote_addr = addr
        self.heard_at = self._loop.time()
        self.quic.receive_datagram(data, addr, now=self._loop.time())
        self._process_events()
        # Deferred one loop turn: a stream reader woken by this datagram usually answers in that
        # turn, so its reply (carrying our ACK) and the post-receive transmit become one call.
        self.transmit_soon()

    def transmit(self) -> None:
        """Send what aioquic has queued and re-arm its timer."""
        self._transmit_handle = None
        for data, addr in self.quic.datagrams_to_send(now=self._loop.time()):
            self.endpoint.sendto(data, addr)
        timer_at = self.quic.get_timer()
        if self._timer is not None and self._timer_at != timer_at:
            self._timer.cancel()
            self._timer = None
        if self._timer is None and timer_at is not None:
            self._timer = self._loop.call_at(timer_at, self._on_timer)
        self._timer_at = timer_at
        if self._sending_watch:
            self._sending_watch = {s: e for s, e in self._sending_watch.items() if not s.on_transmitted(e)}

    def transmit_soon(self) -> None:
        if self._transmit_handle is None:
            self._transmit_handle = self._loop.call_soon(self.transmit)

    def stream_op(self, op: Callable[[MeshQuicConnection], None]) -> None:
        """Apply a stream operation to aioquic; one on a stream aioquic already finished is a no-op."""
        if self.close_reason is not None:
            return
        with contextlib.suppress(ValueError, RuntimeError):
            op(self.quic)
        self.transmit_soon()

    def watch_sending(self, stream: Stream, until_empty: bool = False) -> None:
        """Wake ``stream``'s blocked sender as aioquic transmits (``until_empty``: once all is sent)."""
        self._sending_watch[stream] = until_empty

    def forget_if_finished(self, stream: Stream) -> None:
        if stream.finished and self._streams.get(stream.id) is stream:
            del self._streams[stream.id]
            self.quic.forget_stream(stream.id)

    def _on_timer(self) -> None:
        self._timer = None
        self.quic.handle_timer(now=max(self._timer_at or 0.0, self._loop.time()))
        self._timer_at = None
        self._process_events()
        self.transmit()

    def _process_events(self) -> None:
        while (event := self.quic.next_event()) is not None:
            if isinstance(event, qe.StreamDataReceived):
                self._on_stream_data(event.stream_id, event.data, event.end_stream)
            elif isinstance(event, qe.DatagramFrameReceived):
                if is_probe(event.data):
                    if self.probes is not None:
                        self._apply_probes(self.probes.receive(event.data, self._loop.time()))
                elif self.endpoint.on_datagram is not None and self._serving() and not self.passive:
                    if self._ready.done():
                        self.endpoint.on_datagram(self, event.data)
                    elif len(self._early) < EARLY_DATAGRAMS_MAX:
                        self._early.append(event.data)
            elif isinstance(event, qe.StreamReset):
                stream = self._streams.get(event.stream_id)
                if stream is not None:
                    stream.on_reset(f"reset by peer (code {event.error_code:#x})")
                    self.forget_if_finished(stream)
            elif isinstance(event, qe.StopSendingReceived):
                self.quic.drop_unsent(event.stream_id)
                stream = self._streams.get(event.stream_id)
                if stream is not None:
                    stream.on_stop_sending(f"stopped by peer (code {event.error_code:#x})")
                    self.forget_if_finished(stream)
            elif isinstance(event, qe.ConnectionIdIssued):
                self.endpoint.route(event.connection_id, self)
            elif isinstance(event, qe.ConnectionIdRetired):
                self.endpoint.unroute(event.connection_id)
            elif isinstance(event, qe.HandshakeCompleted):
                self._on_handshake(event)
            elif isinstance(event, qe.ConnectionTerminated):
                self._on_terminated(event)
        if self.close_reason is None and (closed := self.quic.closed_by_peer) is not None:
            # The peer closed: end it for everyone now. aioquic drains it on its own timer, and the
            # endpoint keeps routing its packets there until ConnectionTerminated (then _on_terminated).
            self._on_peer_close(*closed)

    # -- identity and admission ---------------------------------------------------------------

    def _on_handshake(self, event: qe.HandshakeCompleted) -> None:
        try:
            if event.alpn_protocol != ALPN:
                raise VerificationError(f"peer speaks {event.alpn_protocol!r}, not {ALPN}")
            peer = tls.peer_node_id(self.quic.tls)
        except VerificationError as exc:
            self.close(f"bad identity: {exc}", CloseCode.PEER_MISMATCH)
            return
        if self._expected is not None and peer != self._expected:
            self.close(
                f"expected node {short(self._expected)}, certificate is {short(peer)}", CloseCode.PEER_MISMATCH
            )
            return
        if peer == self.endpoint.node_id:
            self.close("connected to ourselves", CloseCode.PEER_MISMATCH)
            return
        if self._handshake_deadline is not None:
            self._handshake_deadline.cancel()
        cooling = self.endpoint.cooling(peer)
        if cooling:
            self.close(f"cooling down for {cooling:.0f} s after overstepping limits", CloseCode.MISBEHAVING)
            return
        self.node_id = peer
        spawn(self._tasks, self._run_sweeps())
        self._admission = Admission(
            dialer=self.dialer,
            local_proof=self.endpoint.local_proof(),
            admit=lambda proof: self._admit_check()(peer, proof, self.dialer),
            peer_addr=self.remote_addr,
            take_grant=None if self.endpoint.take_grant is None else lambda g: self.endpoint.take_grant(peer, g),
            passive=self.endpoint.options.passive,
        )
        if self.dialer:
            stream_id = self.quic.get_next_available_stream_id()
        else:
            stream_id = ADMISSION_STREAM
            self._first_sight(ADMISSION_STREAM)
        stream = self._add_stream(stream_id, "admission", ADMISSION_FRAME_MAX, None)
        spawn(self._tasks, self._run_admission(stream, self._admission))

    async def _run_admission(self, stream: Stream, admission: Admission) -> None:
        try:
            outgoing = admission.start() if admission.dialer else []
            while not admission.done:
                for message in outgoing:
                    stream.send_nowait(message)
                received = await stream.recv(AdmissionMessage, timeout=None)
                if received is None:
                    raise DecodeError("admission stream ended early")
                outgoing = admission.receive(received)
                if admission.serving and self.probes is None:
                    self.probes = ProbeState(
                        self._loop.time(),
                        interval=self.endpoint.options.probe_interval,
                        suspect_after=self.endpoint.options.suspect_after,
                    )
            for message in outgoing:
                stream.send_nowait(message)
            stream.close()
        except MeshllmError as exc:
            if self.close_reason is None:
                self.close(f"admission protocol error: {exc}", CloseCode.PROTOCOL)
            return
        if admission.observed is not None:
            self.observed_addr = normalize_addr(admission.observed)
        if admission.phase is Phase.REFUSED:
            reason = admission.refusal or "refused"
            if not admission.refused_by_peer:
                log.info("refused admission to %s: %s", short(self.node_id or "?"), reason)
            self.close(reason, CloseCode.ADMISSION_REFUSED)
            return
        if self._deadline is not None:
            self._deadline.cancel()
        if self.probes is not None and not self.passive:
            spawn(self._tasks, self._run_probes(self.probes))  # a passive client probes us; we only answer
        if not self._ready.done():
            self._ready.set_result(None)
        self.endpoint.admitted(self)
        # The dialer is admitted on our Welcome and may speak before its Confirm reaches us: what it
        # said meanwhile is handled now that the endpoint holds this connection (a joiner's first
        # summary was answered into a connection nobody held yet, and its first exchange lost).
        early, self._early = self._early, []
        for data in early:
            if self.endpoint.on_datagram is not None and self.close_reason is None:
                self.endpoint.on_datagram(self, data)

    def _admit_check(self) -> Any:
        """The endpoint's admission check for this peer (a passive client's own, when the endpoint has one)."""
        if self.passive and self.endpoint.admit_passive is not None:
            return self.endpoint.admit_passive
        return self.endpoint.admit

    def _serving(self) -> bool:
        return self._admission is not None and self._admission.serving and self.close_reason is None

    # -- streams ------------------------------------------------------------------------------

    def _add_stream(self, stream_id: int, kind: str | None, max_frame: int, budget: int | None) -> Stream:
        stream = Stream(
            self, stream_id, kind=kind, max_frame=max_frame,
            send_budget=self.endpoint.options.send_budget if budget is None else budget,
        )
        self._streams[stream_id] = stream
        self._has_streams.set()
        if kind is not None:
            self._note_kind(kind)
        self.quic.track_stream(stream_id)
        return stream

    def _on_stream_data(self, stream_id: int, data: bytes, end: bool) -> None:
        stream = self._streams.get(stream_id)
        if stream is None:
            if (stream_id & 1) == (0 if self.dialer else 1) or not self._first_sight(stream_id):
                return  # one of ours, or an old stream of theirs we already forgot
            if not self._serving():
                log.warning("resetting stream #%d from %s: not admitted", stream_id, self.remote_addr)
                self.stream_op(lambda q: q.reset_stream(stream_id, ResetCode.NOT_ADMITTED))
                self.stream_op(lambda q: q.stop_stream(stream_id, ResetCode.NOT_ADMITTED))
                return
            stream = self._add_stream(stream_id, None, CONTROL_FRAME_MAX, None)
        stream.feed(data, end)
        if stream.kind is None and stream.held_kind is None:
            self._dispatch(stream)
        self.forget_if_finished(stream)

    def _first_sight(self, stream_id: int) -> bool:
        """Record that the peer's ``stream_id`` has been seen; False if it was seen before.

        Packets reorder: a stream's first data may arrive after a higher stream's, so ids below
        the highest seen are remembered as unseen until their data comes, rather than taken for
        streams we already finished and forgot.
        """
        if stream_id in self._peer_unseen:
            self._peer_unseen.discard(stream_id)
            return True
        kind = stream_id & 3
        expected = self._peer_next.get(kind, kind)
        if stream_id < expected:
            return False
        skipped = range(expected, stream_id, 4)
        room = MAX_UNSEEN_PEER_STREAMS - len(self._peer_unseen)
        if len(skipped) > room:
            log.warning("peer %s skipped %d stream ids; forgetting the oldest", self.remote_addr, len(skipped))
            skipped = skipped[len(skipped) - max(0, room):]
        self._peer_unseen.update(skipped)
        self._peer_next[kind] = stream_id + 4
        return True

    def _dispatch(self, stream: Stream) -> None:
        try:
            header = stream.take_header()
        except DecodeError as exc:
            stream.fail(ResetCode.BAD_FRAME, f"bad stream header: {exc}")
            return
        if header is None:
            if stream.ended:
                stream.fail(ResetCode.BAD_FRAME, "stream ended before its header")
            return
        registered = self.endpoint.handler_for(header.kind)
        if registered is None and self.endpoint.starting:  # its service may not have registered it yet
            stream.hold(header.kind)
            spawn(self._tasks, self._dispatch_once_started(stream, header.kind))
            return
        self._bind(stream, header.kind, registered)

    async def _dispatch_once_started(self, stream: Stream, kind: str) -> None:
        registered = await self.endpoint.handler_once_started(kind)
        if stream.finished:  # reset meanwhile
            self.forget_if_finished(stream)
            return
        self._bind(stream, kind, registered)

    def _bind(self, stream: Stream, kind: str, registered: tuple[Any, int] | None) -> None:
        """Run ``kind``'s handler on ``stream``, or refuse the stream when no handler serves it."""
        if registered is None:
            stream.fail(ResetCode.UNKNOWN_KIND, f"no handler for stream kind {kind!r}")
            return
        handler, max_frame = registered
        stream.bind(kind, max_frame)
        self._note_kind(kind)
        spawn(self._tasks, self._run_handler(handler, stream))

    async def _run_handler(self, handler: Any, stream: Stream) -> None:
        try:
            await self.wait_admitted()  # (a stream the dialer opened before its Confirm reached us)
        except ConnectError:
            return  # its admission failed after all: the connection is closing, and the stream with it
        try:
            await handler(stream, self)
            stream.close()
            stream.discard_input()  # the handler is done reading: what else comes is dropped
        except StreamClosed as exc:
            log.debug("%r ended: %s", stream, exc)
        except Exception:
            log.exception("handler for stream kind %r failed", stream.kind)
            stream.reset(ResetCode.HANDLER_FAILED)
        self.forget_if_finished(stream)

    async def _run_sweeps(self) -> None:
        """Reset streams whose header or current frame is overdue (a trickle never holds a stream).

        A sweep that wakes up late measures our own loop's stall: that time is forgiven, so a busy
        node never blames its peers for frames it was too slow to read. With no stream open it waits
        for one: a member holding hundreds of quiet passive clients' connections pays nothing for them.
        """
        due = self._loop.time() + SWEEP_INTERVAL_S
        while self.close_reason is None:
            if not self._streams:
                self._has_streams.clear()
                await self._has_streams.wait()
                due = self._loop.time() + SWEEP_INTERVAL_S
            await asyncio.sleep(max(0.0, due - self._loop.time()))
            now = self._loop.time()
            lag, due = now - due, now + SWEEP_INTERVAL_S
            if lag > SWEEP_INTERVAL_S:
                for stream in self._streams.values():
                    stream.forgive(lag)
            for stream in list(self._streams.values()):
                reason = stream.overdue(now)
                if reason is not None:
                    stream.fail(ResetCode.TIMEOUT, reason)
                    self.forget_if_finished(stream)
                    self.strike(f"{stream.kind or 'stream'}: {reason}")

    # -- probes -------------------------------------------------------------------------------

    async def _run_probes(self, probes: ProbeState) -> None:
        """Ping every ``probe_interval`` while the connection carries work or the peer is suspect (a verdict
        frozen by a pause would keep a peer that was only slow out of routing), else every
        ``idle_probe_interval``, or not at all when that is None: a quiet connection then costs its peer
        nothing, and the first stream of work starts the probes again at once."""
        options = self.endpoint.options
        while self.close_reason is None:
            busy = probes.state is Liveness.SUSPECT or self.carries_work()
            interval = options.probe_interval if busy else options.idle_probe_interval
            if interval is not None:
                interval *= self.endpoint.patience(self.node_id or "")  # a miss is counted per interval
            self._work.clear()
            self._probing = interval is not None
            if interval is None:
                await self._work.wait()
                probes.pace(options.probe_interval * self.endpoint.patience(self.node_id or ""), self._loop.time())
                continue
            now = self._loop.time()
            if interval != probes.interval:
                probes.pace(interval, now)
            self._apply_probes(probes.poll(now, self.heard_at))
            delay = max(0.0, probes.next_deadline - self._loop.time())
            if busy:
                await asyncio.sleep(delay)
            else:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._work.wait(), delay)

    def carries_work(self) -> bool:
        """Whether a stream of a kind that is not quiet (``EndpointOptions.quiet_kinds``) is open."""
        quiet = self.endpoint.options.quiet_kinds
        return any(s.kind is not None and s.kind not in quiet for s in self._streams.values())

    def _note_kind(self, kind: str) -> None:
        if kind not in self.endpoint.options.quiet_kinds:
            self._work.set()

    def send_datagram(self, data: bytes) -> bool:
        """Send ``data`` as one unreliable QUIC DATAGRAM (a loss is the caller's signal, never retried).

        Returns False, sending nothing, when the connection is closed or :data:`MAX_PENDING_DATAGRAMS`
        wait already: datagrams are best-effort, and a flood must never grow aioquic's queue. Data must not
        look like a probe (:func:`~meshllm.net.probes.is_probe`): the peer would take it for one.
        """
        if self.close_reason is not None or self.quic.datagrams_pending() >= MAX_PENDING_DATAGRAMS:
            return False
        self.quic.send_datagram_frame(data)
        self.transmit_soon()
        return True

    def _apply_probes(self, out: ProbeOutput) -> None:
        for datagram in out.datagrams:
            if not self.send_datagram(datagram):
                break
        if self.endpoint.peers.get(self.node_id or "") is not self:
            return  # a replaced (retiring) connection's liveness says nothing about the peer
        for change in out.events:
            kind = PeerEventKind.SUSPECT if change.state is Liveness.SUSPECT else PeerEventKind.ALIVE
            self.endpoint.emit(PeerEvent(kind, self.node_id or "", change.rtt_ms))

    # -- ending -------------------------------------------------------------------------------

    def _on_terminated(self, event: qe.ConnectionTerminated) -> None:
        self._on_peer_close(event.error_code, event.reason_phrase)
        if self._timer is not None:
            self._timer.cancel()
        self.endpoint.forget(self)

    def _on_peer_close(self, code: int, phrase: str) -> None:
        """The connection ended by the peer's word (or aioquic's: an idle timeout): a no-op if we closed it."""
        if self.close_reason is not None:
            return
        reason = phrase or f"closed by peer (code {code:#x})"
        self._finish(reason, self._error_for(code, reason, local=False))
        log.debug("connection to %s ended: %s", self.remote_addr, reason)

    def _error_for(self, code: int, reason: str, *, local: bool) -> ConnectError:
        if code == CloseCode.ADMISSION_REFUSED:
            return AdmissionRefused(reason)
        if code == CloseCode.PEER_MISMATCH:
            return PeerMismatch(reason if local else f"peer refused our identity: {reason}")
        where = f"{self.remote_addr[0]}:{self.remote_addr[1]}"
        return ConnectError(f"connection to {where} closed before admission: {reason}")

    def _finish(self, reason: str, error: ConnectError) -> None:
        if self.close_reason is not None:
            return
        self.close_reason = reason
        if self._deadline is not None:
            self._deadline.cancel()
        if self._handshake_deadline is not None:
            self._handshake_deadline.cancel()
        if not self._ready.done():
            self._ready.set_exception(error)
            self._ready.exception()  # mark retrieved: a dial nobody awaits must not log
        for stream in self._streams.values():
            stream.on_connection_closed(reason)
        for task in self._tasks:
            if task is not asyncio.current_task():
                task.cancel()
        self.endpoint.removed(self)

    def abandon(self) -> None:
        """Stop all timers (the endpoint's socket is going away)."""
        for handle in (self._timer, self._transmit_handle, self._deadline, self._handshake_deadline):
            if handle is not None:
                handle.cancel()
        self._timer = self._transmit_handle = None
