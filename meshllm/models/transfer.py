"""Model bytes over the mesh: stream kind ``model-fetch``, a piece scheduler, and the fetch driver.

**Protocol** (one short stream per request, msgspec tagged frames): the requester sends
``Want{model, offset, length}`` and the holder answers with ``Bytes{offset, data}`` frames covering
the range in order, then ends the stream; or ``WantManifest{model}`` -> ``ManifestReply{manifest}``
(signed by the holder). Anything it cannot serve is a ``Refused{message}``. Models are named by id
only: a holder serves whole files its library holds and advertises, never a path from the network.

**Scheduling** (:class:`TransferState`, sans-IO): the pieces still missing wait in a queue; each
holder takes the next one when it has a free slot (``window`` per holder), so a faster holder ends
up sending more. A piece that arrives is checked against its sha256 before it is written; a holder
that sends a bad piece, fails or stalls is dropped for this transfer and its pieces go back to the
queue for the others. The transfer fails only when no holder is left.

**Resume**: the output file is written in place (sparse where pieces are missing); a transfer that
finds the file already there checks each piece it would fetch and keeps those that verify.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections import deque
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated

import msgspec
from msgspec import Meta

from meshllm.errors import DecodeError, MeshllmError
from meshllm.identity.ids import short
from meshllm.models.manifest import MAX_FILE, MAX_MANIFEST, MODEL_ID, Manifest, Piece, open_manifest
from meshllm.models.stage_file import Layout
from meshllm.net import Endpoint, NetError, PeerConnection, Stream
from meshllm.net.limits import ByteRate
from meshllm.wire.addr import parse_addr

log = logging.getLogger(__name__)

KIND = "model-fetch"
DATA_FRAME = 256 << 10
"""Bytes per ``Bytes`` frame: big enough to amortise framing, small enough to interleave streams."""
MAX_WANT = 64 << 20
"""Most bytes one request may ask for (a piece is 4 MiB)."""
REPLY_FRAME_MAX = MAX_MANIFEST + 4096
"""Frames a requester accepts back: a data frame, or a signed manifest."""
WINDOW = 2
"""Requests in flight per holder: one streams while the next is already asked for."""
STALL_S = 10.0
"""A holder that sends nothing for this long is dropped."""
CONNECT_S = 3.0
PER_PEER_STREAMS = 8
"""Requests a holder serves at once for one peer (more wait: a member cannot take every slot)."""
TOTAL_STREAMS = 32

ModelId = Annotated[str, Meta(pattern=MODEL_ID.pattern)]


class Want(msgspec.Struct, frozen=True, kw_only=True, tag="want"):
    model: ModelId
    offset: Annotated[int, Meta(ge=0, lt=MAX_FILE)]
    length: Annotated[int, Meta(ge=1, le=MAX_WANT)]


class WantManifest(msgspec.Struct, frozen=True, kw_only=True, tag="want-manifest"):
    model: ModelId


class Bytes(msgspec.Struct, frozen=True, kw_only=True, tag="bytes"):
    offset: int
    data: bytes


class ManifestReply(msgspec.Struct, frozen=True, kw_only=True, tag="manifest"):
    manifest: bytes
    """The holder's manifest of the model, signed by the holder's node key."""


class Refused(msgspec.Struct, frozen=True, kw_only=True, tag="refused"):
    message: str


Request = Want | WantManifest
Reply = Bytes | ManifestReply | Refused


class TransferFailed(MeshllmError):
    """A model (or a stage of one) could not be fetched from any holder."""

    hint = "check that a node holding the model is alive (`meshllm models list` shows who has it)"


# -- the sans-IO core ---------------------------------------------------------------------------


@dataclass
class HolderState:
    node_id: str
    addr: str
    in_flight: set[int] = field(default_factory=set)
    """Indices (into ``TransferState.pieces``) this holder is fetching."""
    bytes: int = 0
    dropped: str | None = None
    """Why it was dropped from this transfer (None while it takes part)."""
    bad: bool = False
    """Dropped for sending bytes that do not match the manifest."""


class TransferState:
    """Which pieces are missing, who fetches which, and who was dropped. No I/O, no clock."""

    def __init__(self, pieces: list[Piece], holders: list[tuple[str, str]], window: int = WINDOW) -> None:
        self.pieces = pieces
        self.window = window
        self.holders = {node: HolderState(node, addr) for node, addr in holders}
        self.pending: deque[int] = deque(range(len(pieces)))
        self.done: set[int] = set()
        self.total_bytes = sum(p.length for p in pieces)
        self.done_bytes = 0

    def join(self, node: str, addr: str) -> bool:
        """A holder found after the transfer began takes part from now on; False when it is known already
        (a dropped holder stays dropped)."""
        if node in self.holders:
            return False
        self.holders[node] = HolderState(node, addr)
        return True

    def skip(self, index: int) -> None:
        """Piece ``index`` is already on disk and verified (a resumed transfer)."""
        if index in self.pending:
            self.pending.remove(index)
        self.done.add(index)
        self.done_bytes += self.pieces[index].length

    def take(self, node: str) -> int | None:
        """The next piece for ``node`` to fetch, or None (no free slot, nothing pending, or dropped)."""
        holder = self.holders[node]
        if holder.dropped is not None or len(holder.in_flight) >= self.window or not self.pending:
            return None
        index = self.pending.popleft()
        holder.in_flight.add(index)
        return index

    def arrived(self, node: str, index: int, ok: bool) -> None:
        """``node`` delivered piece ``index``; ``ok`` when it matched its digest (else ``node`` is dropped)."""
        holder = self.holders[node]
        holder.in_flight.discard(index)
        if not ok:
            self._requeue(index)
            self.drop(node, f"sent piece {index} with a wrong sha256", bad=True)
            return
        if index not in self.done:
            self.done.add(index)
            self.done_bytes += self.pieces[index].length
            holder.bytes += self.pieces[index].length

    def failed(self, node: str, index: int, reason: str) -> None:
        """Fetching piece ``index`` from ``node`` failed (stream error, refusal, stall): drop ``node``."""
        self.holders[node].in_flight.discard(index)
        self._requeue(index)
        self.drop(node, reason)

    def drop(self, node: str, reason: str, *, bad: bool = False) -> None:
        holder = self.holders[node]
        if holder.dropped is None:
            holder.dropped, holder.bad = reason, bad
        for index in holder.in_flight:
            self._requeue(index)
        holder.in_flight.clear()

    def _requeue(self, index: int) -> None:
        if index not in self.done and index not in self.pending:
            self.pending.appendleft(index)

    @property
    def finished(self) -> bool:
        return len(self.done) == len(self.pieces)

    @property
    def live(self) -> list[str]:
        return [n for n, h in self.holders.items() if h.dropped is None]

    def why_stuck(self) -> str:
        return "; ".join(f"{short(n)}: {h.dropped}" for n, h in self.holders.items()) or "no node holds it"


# -- the holder side ----------------------------------------------------------------------------

Locate = Callable[[str], Path | None]
"""``locate(model_id)``: the whole file of that model this node offers to peers, or None."""
SignedManifest = Callable[[str], bytes]
"""``signed_manifest(model_id)``: its manifest signed by this node (blocking: run in a thread)."""
Pace = Callable[[int], Awaitable[None]]
"""``await pace(n)`` before sending ``n`` bytes of a model: returns when the node's upload cap allows it."""


def upload_pace(bytes_per_s: float) -> Pace:
    """One cap on the rate this node sends model bytes to peers, shared by every stream and channel
    (``model_upload_limit_mb_s`` in config.toml: an uplink the owner also uses for other things)."""
    budget = ByteRate(bytes_per_s, burst=DATA_FRAME)

    async def pace(n: int) -> None:
        wait = budget.reserve(n, time.monotonic())
        if wait > 0:
            await asyncio.sleep(wait)

    return pace


class TransferServer:
    """Serves ``model-fetch`` streams from the node's library."""

    def __init__(self, endpoint: Endpoint, locate: Locate, signed_manifest: SignedManifest,
                 pace: Pace | None = None) -> None:
        """``pace``: the node's upload cap (None: none)."""
        self.locate = locate
        self.signed_manifest = signed_manifest
        self.pace = pace
        self._per_peer: dict[str, int] = {}
        self._total = asyncio.Semaphore(TOTAL_STREAMS)
        # the cap applies both ways on a stream: it must fit a signed manifest going out
        endpoint.on_stream(KIND, self._serve, max_frame=REPLY_FRAME_MAX)

    async def _serve(self, stream: Stream, peer: PeerConnection) -> None:
        peer_id = peer.node_id or ""
        request = await stream.recv(Request, timeout=5.0)
        if request is None:
            return
        if self._per_peer.get(peer_id, 0) >= PER_PEER_STREAMS:
            await stream.send(Refused(message=f"too many requests at once (at most {PER_PEER_STREAMS})"))
            return
        self._per_peer[peer_id] = self._per_peer.get(peer_id, 0) + 1
        try:
            async with self._total:
                await self._answer(stream, request)
        finally:
            self._per_peer[peer_id] -= 1
            if not self._per_peer[peer_id]:
                del self._per_peer[peer_id]

    async def _answer(self, stream: Stream, request: Request) -> None:
        if isinstance(request, WantManifest):
            if self.locate(request.model) is None:
                await stream.send(Refused(message=f"this node does not offer model {request.model[:12]}"))
                return
            try:
                signed = await asyncio.to_thread(self.signed_manifest, request.model)
            except (MeshllmError, OSError) as exc:
                await stream.send(Refused(message=f"no manifest for {request.model[:12]}: {exc}"))
                return
            await stream.send(ManifestReply(manifest=signed))
            return
        try:
            fd = open_range(self.locate, request)
        except RangeRefused as exc:
            await stream.send(Refused(message=str(exc)))
            return
        try:
            at, end = request.offset, request.offset + request.length
            while at < end:
                data = await read_chunk(fd, at, min(DATA_FRAME, end - at))
                if self.pace is not None:
                    await self.pace(len(data))
                await stream.send(Bytes(offset=at, data=data), timeout=STALL_S)
                at += len(data)
        except RangeRefused as exc:
            await stream.send(Refused(message=str(exc)))
        finally:
            os.close(fd)


class RangeRefused(MeshllmError):
    """A range this node cannot serve (not offered, unreadable, past the end): sent as ``Refused``."""


def open_range(locate: Locate, want: Want) -> int:
    """A read-only descriptor on the model file ``want`` names, checked to hold its range."""
    path = locate(want.model)
    if path is None:
        raise RangeRefused(f"this node does not offer model {want.model[:12]}")
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError as exc:
        raise RangeRefused(f"cannot read model {want.model[:12]}: {exc.strerror}") from None
    size = os.fstat(fd).st_size
    if want.offset + want.length > size:
        os.close(fd)
        raise RangeRefused(f"range ends past the model's {size} bytes")
    return fd


async def read_chunk(fd: int, offset: int, length: int) -> bytes:
    """``length`` bytes at ``offset`` (read off the loop); a short read means the file shrank."""
    data = await asyncio.to_thread(os.pread, fd, length, offset)
    if len(data) != length:
        raise RangeRefused("the model file shrank")
    return data


# -- the requester side -------------------------------------------------------------------------

Progress = Callable[[TransferState], None]
Holders = Callable[[], Iterable[tuple[str, str]]]
"""``more()``: the holders (node id, ``host:port``) a running transfer may add, as known now."""
JOIN_POLL_S = 1.0
"""How often a running transfer looks for holders found since it began."""
GetRange = Callable[[str, str, str, int, int], Awaitable[bytes]]
"""``get(node_id, addr, model, offset, length)``: those bytes from that holder (the channel is the getter's
choice: :func:`get_range` over QUIC, or the store's TLS-over-TCP channel with QUIC as its fallback)."""


async def _connect(endpoint: Endpoint, node_id: str, addr: str) -> PeerConnection:
    return await endpoint.connect(parse_addr(addr), node_id, timeout=CONNECT_S)


async def get_range(endpoint: Endpoint, node_id: str, addr: str, model: str, offset: int, length: int) -> bytes:
    """Bytes ``[offset, offset + length)`` of ``model`` from one holder; NetError/TransferFailed on failure."""
    conn = await _connect(endpoint, node_id, addr)
    stream = await conn.open_stream(KIND, max_frame=REPLY_FRAME_MAX)
    try:
        await stream.send(Want(model=model, offset=offset, length=length))
        parts = []
        at = offset
        while at < offset + length:
            reply = await stream.recv(Reply, timeout=STALL_S)
            if reply is None:
                raise TransferFailed(f"node {short(node_id)} ended the stream after {at - offset} bytes")
            if isinstance(reply, Refused):
                raise TransferFailed(f"node {short(node_id)} refused: {reply.message}")
            if not isinstance(reply, Bytes) or reply.offset != at or not reply.data:
                raise TransferFailed(f"node {short(node_id)} sent bytes out of order")
            parts.append(reply.data)
            at += len(reply.data)
        if at != offset + length:
            raise TransferFailed(f"node {short(node_id)} sent more bytes than asked for")
    except BaseException:
        stream.reset()
        raise
    stream.close()
    return b"".join(parts)


async def get_manifest(endpoint: Endpoint, node_id: str, addr: str, model: str) -> tuple[Manifest, bytes]:
    """A holder's manifest of ``model`` (checked to be signed by it) and its signed bytes."""
    conn = await _connect(endpoint, node_id, addr)
    stream = await conn.open_stream(KIND, max_frame=REPLY_FRAME_MAX)
    try:
        await stream.send(WantManifest(model=model))
        reply = await stream.recv(Reply, timeout=60.0)
    finally:
        stream.reset()
    if isinstance(reply, Refused):
        raise TransferFailed(f"node {short(node_id)} refused: {reply.message}")
    if not isinstance(reply, ManifestReply):
        raise TransferFailed(f"node {short(node_id)} did not send a manifest")
    return open_manifest(reply.manifest, node_id, model), reply.manifest


def plan_pieces(manifest: Manifest, layout: Layout) -> list[Piece]:
    """Every piece of the spans the layout places (the header span too for a whole file)."""
    return [p for i in sorted(layout.placements) for p in manifest.pieces(i)]


def prepare_output(out: Path, layout: Layout) -> bool:
    """Create (or keep, for a resume) the output file at its final length; True if it already existed."""
    existed = out.exists()
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("r+b" if existed else "wb") as fh:
        if layout.header is not None:
            fh.seek(0)
            fh.write(layout.header)
        fh.truncate(layout.size)
    return existed


def verified_on_disk(out: Path, manifest: Manifest, layout: Layout, pieces: list[Piece]) -> list[int]:
    """Indices of ``pieces`` already written correctly in ``out`` (blocking)."""
    good = []
    fd = os.open(out, os.O_RDONLY)
    try:
        for k, piece in enumerate(pieces):
            if piece.check(os.pread(fd, piece.length, layout.dest(piece, manifest))):
                good.append(k)
    finally:
        os.close(fd)
    return good


async def fetch(get: GetRange, manifest: Manifest, layout: Layout, holders: list[tuple[str, str]], out: Path,
                *, progress: Progress | None = None, window: int = WINDOW,
                more: Holders | None = None) -> TransferState:
    """Fetch the pieces ``layout`` places into ``out`` from ``holders`` (node id, ``host:port``) in parallel,
    each piece through ``get``. ``more()``, asked at least every :data:`JOIN_POLL_S` while pieces are
    missing, names holders found since (a node that just joined a mesh learns of the others while its
    first transfer runs); they join it.

    Returns the final state (who sent what, who was dropped and why); raises
    :class:`TransferFailed` when pieces are missing and no holder is left.
    """
    pieces = plan_pieces(manifest, layout)
    state = TransferState(pieces, holders, window)
    if await asyncio.to_thread(prepare_output, out, layout):
        for k in await asyncio.to_thread(verified_on_disk, out, manifest, layout, pieces):
            state.skip(k)
    if progress is not None:
        progress(state)
    fd = os.open(out, os.O_WRONLY)
    wake = asyncio.Event()
    tasks: dict[tuple[str, int], asyncio.Task[None]] = {}

    async def one(node: str, index: int) -> None:
        piece = pieces[index]
        holder = state.holders[node]
        try:
            data = await get(node, holder.addr, manifest.model, piece.offset, piece.length)
        except (NetError, OSError, DecodeError, TransferFailed) as exc:
            state.failed(node, index, str(exc))
            log.info("dropped holder %s of %s: %s", short(node), manifest.model[:12], exc)
        else:
            ok = piece.check(data)
            if ok:
                await asyncio.to_thread(os.pwrite, fd, data, layout.dest(piece, manifest))
            else:
                log.warning("holder %s sent a bad piece of %s; dropping it", short(node), manifest.model[:12])
            state.arrived(node, index, ok)
            if progress is not None:
                progress(state)
        finally:
            tasks.pop((node, index), None)
            wake.set()

    def join() -> None:
        for node, addr in more() if more is not None else ():
            if state.join(node, addr):
                log.info("holder %s joined the transfer of %s", short(node), manifest.model[:12])

    try:
        while not state.finished:
            join()
            for node in state.live:
                while (index := state.take(node)) is not None:
                    tasks[(node, index)] = asyncio.create_task(one(node, index))
            for (node, _), task in list(tasks.items()):
                if state.holders[node].dropped is not None:
                    task.cancel()
            if not tasks and not state.finished:
                raise TransferFailed(f"model {manifest.model[:12]}: {len(state.pending)} pieces left and no "
                                     f"holder to fetch them from ({state.why_stuck()})")
            wake.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(wake.wait(), JOIN_POLL_S if more is not None else None)
        await asyncio.to_thread(os.fsync, fd)
    finally:
        for task in tasks.values():
            task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.gather(*tasks.values(), return_exceptions=True)
        os.close(fd)
        if progress is not None:
            progress(state)
    return state
