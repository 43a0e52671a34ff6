"""Stage lanes: frame decoding and probes, a thin asyncio driver on a stream, and a pool.

A lane is one persistent ``stage-lane`` stream to one peer, shared by every session between the two
nodes, riding a QUIC stream or a TLS connection to the peer's bulk channel (``split/tcp_lane.py``).
:class:`LaneState` decodes and validates each frame within the lane's activation limit and keeps the
probe state; what a frame means for its sessions is the stage core's (``split/stage_core.py``),
which refuses a bad frame for its sessions only, so the lane and its other sessions go on.
:class:`Lane` moves frames between its stream and its owner; :class:`LanePool` keeps one lane per
next-hop node and probes a lane (Ping/Pong) before reusing it.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Union

import msgspec

from meshllm.errors import DecodeError
from meshllm.net import ConnectError, Endpoint, NetError, Stream, StreamClosed
from meshllm.split.errors import BadFrame
from meshllm.split.frames import KIND, LANE_FRAME_MAX, LaneFrame, Ping, Pong, decode_frame
from meshllm.split.stage_core import LaneId, lane_id
from meshllm.tasks import Scope

if TYPE_CHECKING:
    from meshllm.split.tcp_lane import TcpStream

from meshllm.wire.addr import parse_addr

LaneStream = Union[Stream, "TcpStream"]
"""What a lane's frames ride: a QUIC stream, or a TLS connection to the peer's bulk channel."""

log = logging.getLogger(__name__)

PROBE_TIMEOUT = 0.25
"""A lane that does not answer a Ping this much later than its round trip is not reused."""


def probe_timeout(endpoint: Endpoint, node_id: str) -> float:
    """How long a Ping to ``node_id`` may take: :data:`PROBE_TIMEOUT` on top of its measured RTT.

    A fixed 250 ms would fail every probe of a peer 250 ms away (another continent) and replace its
    lane on every reuse; the slack on top of the RTT is what detects a stage that stopped answering.
    """
    peer = endpoint.peers.get(node_id)
    rtt_ms = peer.rtt_ms if peer is not None else None
    return PROBE_TIMEOUT + (rtt_ms or 0.0) / 1000.0
Dial = Callable[[str, str], Awaitable["LaneStream | None"]]
"""``dial(node_id, host)``: a lane stream over the peer's bulk channel at ``host``, or None (use QUIC)."""
MAX_ACTIVATION_BYTES = 16 * 1024 * 1024
"""Largest activation payload a lane accepts; larger frames get a ``too-large`` Error."""


class LaneState:
    """Receive-side state of one lane: frame decoding within its activation limit, and the probe in flight.

    What a frame means for its sessions (order, dtype, plan membership) is the stage core's
    (:class:`~meshllm.split.stage_core.StageCore`), which keeps the one session table.
    """

    def __init__(self, peer_id: str, *, max_activation_bytes: int = MAX_ACTIVATION_BYTES) -> None:
        self.peer_id = peer_id
        self.max_activation_bytes = max_activation_bytes
        self._nonces = itertools.count(1)
        self._probe: tuple[int, float] | None = None

    def receive(self, raw: bytes) -> LaneFrame:
        """The validated frame in ``raw``; :class:`BadFrame` (with session and code) if it must be refused."""
        return decode_frame(raw, max_activation_bytes=self.max_activation_bytes)

    # -- probes --------------------------------------------------------------------------------

    def ping(self, now: float, session: str = "") -> Ping:
        """Start a probe; the lane is healthy once :meth:`pong` matches it before ``now + timeout``."""
        nonce = next(self._nonces)
        self._probe = (nonce, now)
        return Ping(nonce=nonce, session=session)

    def pong(self, frame: Pong, now: float, timeout: float = PROBE_TIMEOUT) -> bool:
        """Whether ``frame`` answers the probe in flight in time (a stale pong is ignored)."""
        if self._probe is None or frame.nonce != self._probe[0]:
            return False
        ok = now - self._probe[1] <= timeout
        self._probe = None
        return ok


class Lane:
    """Driver of one lane: a reader task feeding :class:`LaneState`, and ``send``.

    ``on_frame(lane, frame)`` gets every frame read except Pongs (which answer :meth:`probe`), or the
    :class:`BadFrame` saying why one could not be read; ``on_close(lane, reason)`` is called once when
    the stream ends.
    """

    def __init__(
        self,
        stream: LaneStream,
        peer_id: str,
        on_frame: Callable[[Lane, LaneFrame | BadFrame], Awaitable[None]],
        on_close: Callable[[Lane, str], None] | None = None,
        *,
        send_timeout: float = 5.0,
        max_activation_bytes: int = MAX_ACTIVATION_BYTES,
    ) -> None:
        self.stream = stream
        self.peer_id = peer_id
        self.id: LaneId = lane_id(peer_id)
        """How the stage core names this lane."""
        self.state = LaneState(peer_id, max_activation_bytes=max_activation_bytes)
        self.closed: str | None = None
        """Why the lane ended, once it has."""
        self._on_frame = on_frame
        self._on_close = on_close
        self._send_timeout = send_timeout
        self._pongs: dict[int, asyncio.Future[Pong]] = {}
        self._loop = asyncio.get_running_loop()

    async def send(self, frame: LaneFrame) -> None:
        """Send one frame; :class:`~meshllm.net.NetError` if the lane is gone or stalled."""
        if self.closed is not None:
            raise StreamClosed(f"lane to {self.peer_id[:12]} is closed: {self.closed}")
        await self.stream.send(frame, timeout=self._send_timeout)

    async def probe(self, timeout: float = PROBE_TIMEOUT, session: str = "") -> Pong | None:
        """Ping the peer; its Pong, or None if it did not answer within ``timeout``."""
        ping = self.state.ping(self._loop.time(), session)
        future: asyncio.Future[Pong] = self._loop.create_future()
        self._pongs[ping.nonce] = future
        try:
            await self.send(ping)
            pong = await asyncio.wait_for(future, timeout)
        except (NetError, TimeoutError):
            return None
        finally:
            self._pongs.pop(ping.nonce, None)
        return pong if self.state.pong(pong, self._loop.time(), timeout) else None

    async def run(self) -> None:
        """Read frames until the stream ends; returns normally on a clean end, else after ``on_close``."""
        reason = "ended by peer"
        try:
            while (raw := await self.stream.recv(msgspec.Raw, timeout=None)) is not None:
                await self._handle(bytes(raw))
        except NetError as exc:
            reason = str(exc)
        finally:
            self._end(reason)

    def close(self, reason: str = "closed") -> None:
        """End the lane (both directions)."""
        self.stream.reset()
        self._end(reason)

    async def _handle(self, raw: bytes) -> None:
        frame: LaneFrame | BadFrame
        try:
            frame = self.state.receive(raw)
        except BadFrame as exc:
            log.info("refused a frame from %s: %s", self.peer_id[:12], exc)
            frame = exc
        if isinstance(frame, Pong):
            future = self._pongs.get(frame.nonce)
            if future is not None and not future.done():
                future.set_result(frame)
            return
        await self._on_frame(self, frame)

    def _end(self, reason: str) -> None:
        if self.closed is not None:
            return
        self.closed = reason
        for future in self._pongs.values():
            if not future.done():
                future.cancel()
        if self._on_close is not None:
            self._on_close(self, reason)


class LanePool:
    """Outgoing lanes by next-hop node id; a pooled lane is probed before it is reused."""

    def __init__(
        self,
        endpoint: Endpoint,
        on_frame: Callable[[Lane, LaneFrame | BadFrame], Awaitable[None]],
        on_close: Callable[[Lane, str], None] | None = None,
        *,
        connect_timeout: float = 1.0,
        dial: Dial | None = None,
    ) -> None:
        self.endpoint = endpoint
        self.dial = dial
        """Opens a lane over the peer's bulk channel (``split/tcp_lane.py``) where its QUIC path is direct."""
        self._on_frame = on_frame
        self._on_close = on_close
        self._connect_timeout = connect_timeout
        self._lanes: dict[str, Lane] = {}
        self._locks: dict[str, asyncio.Lock] = {}
        self._scope = Scope("lane pool")
        """The pooled lanes' readers."""

    async def get(self, node_id: str, addr: str) -> Lane:
        """A live lane to ``node_id`` (dialing ``host:port`` if needed); :class:`NetError` if unreachable."""
        async with self._locks.setdefault(node_id, asyncio.Lock()):
            lane = self._lanes.get(node_id)
            timeout = probe_timeout(self.endpoint, node_id)
            # a second, longer chance before replacing it: the lane carries other sessions, and a busy
            # peer (or host) can miss one short probe
            if lane is not None and lane.closed is None and (
                    await lane.probe(timeout) is not None or await lane.probe(4 * timeout) is not None):
                return lane
            if lane is not None:
                lane.close("probe failed before reuse")
            try:
                target = parse_addr(addr)
            except DecodeError as exc:
                raise ConnectError(f"bad address for {node_id[:12]}: {exc}") from None
            peer = await self.endpoint.connect(target, node_id, timeout=self._connect_timeout)
            # the QUIC connection proved who the peer is and where: a direct path may carry the lane on TCP
            tcp = await self.dial(node_id, peer.remote_addr[0]) if self.dial and peer.path == "direct" else None
            stream = tcp or await peer.open_stream(KIND, max_frame=LANE_FRAME_MAX)
            lane = Lane(stream, node_id, self._on_frame, self._closed)  # type: ignore[arg-type]
            self._lanes[node_id] = lane
            self._scope.spawn(lane.run())
            return lane

    def _closed(self, lane: Lane, reason: str) -> None:
        if self._lanes.get(lane.peer_id) is lane:
            del self._lanes[lane.peer_id]
        if self._on_close is not None:
            self._on_close(lane, reason)

    def close(self) -> None:
        """Close every pooled lane and end their readers."""
        for lane in list(self._lanes.values()):
            lane.close("pool closing")
        self._scope.close()
