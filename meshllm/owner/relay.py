"""Owner envelopes through the mesh: hop by hop over ``owner`` streams to nodes the sender cannot reach.

A command envelope is end-to-end signed and encrypted (``owner/commands.py``), so the nodes that
carry it need no trust in each other: a relay can drop an envelope but can neither read, alter nor
forge one, and a copy it sends twice is refused at the target as a replay.

Protocol, one stream of kind :data:`STREAM_KIND` per hop (frames capped at :data:`FRAME_MAX`): the
sender sends one :class:`Deliver` (the envelope, its target node, the hops it may still take, the
nodes it has passed and the time left); the receiver executes it when it is the target, else hands
it on, and answers with one :class:`Delivered` (the target's signed result envelope, verbatim) or
one :class:`Undeliverable` (why not; unsigned, so only ever a reason to give up).

The next hop is chosen by :func:`next_hops` (sans-IO): the target itself when connected, else the
connected peers on the shortest paths to it over the links in gossiped records (each record's RTT
row names the peers its node is connected to); a node with no such path dials the target at its
gossiped addresses. Limits (docs/protocol.md): per-peer rate of envelopes with strikes for
overstepping, a bound on relays in flight per peer and in all, a hop limit, a path that never
revisits a node, deadlines on every read and on the whole delivery.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable, Collection, Iterable, Mapping
from typing import Annotated

import msgspec

from meshllm.errors import DecodeError, MeshllmError
from meshllm.identity.ids import short
from meshllm.mesh.service import MeshService
from meshllm.net.connection import PeerConnection
from meshllm.net.errors import NetTimeout, StreamClosed
from meshllm.net.limits import RateLimit
from meshllm.net.messages import ResetCode
from meshllm.net.streams import Stream
from meshllm.owner.commands import MAX_TIMEOUT_S, envelope_target

log = logging.getLogger(__name__)

STREAM_KIND = "owner"
FRAME_MAX = 64 * 1024
MAX_ENVELOPE = 16 * 1024
MAX_RESULT = 48 * 1024
MAX_HOPS = 4
"""Relays an envelope may pass before it is dropped (a mesh's partial views are a few hops across)."""
MAX_PATH = 8
MAX_ATTEMPTS = 3
"""Next hops one node tries for an envelope (bounds the fan-out to ``MAX_ATTEMPTS ** MAX_HOPS``)."""
MAX_DELIVERY_S = MAX_TIMEOUT_S + 30.0
REQUEST_TIMEOUT_S = 5.0
"""A peer that opened an owner stream must send its Deliver frame within this."""
CONNECT_TIMEOUT_S = 3.0
SEND_TIMEOUT_S = 5.0
RATE_PER_S = 20.0
RATE_BURST = 100
"""Envelopes one peer may hand us: a burst of 100, then 20 a second. An owner's script steering many
nodes through one relay stays far below; each costs the receiver a decode, and its target a signature
check and a read of its trust store, so a flood past this is cheap to refuse."""
IN_FLIGHT_PER_PEER = 4
IN_FLIGHT_TOTAL = 32

NodeIdText = Annotated[str, msgspec.Meta(max_length=64)]


class Deliver(msgspec.Struct, frozen=True, tag="deliver", forbid_unknown_fields=True):
    """Carry ``envelope`` to ``target``."""

    envelope: Annotated[bytes, msgspec.Meta(max_length=MAX_ENVELOPE)]
    target: NodeIdText
    hops: Annotated[int, msgspec.Meta(ge=0, le=MAX_HOPS)]
    """Relays it may still pass after the receiver."""
    path: Annotated[list[NodeIdText], msgspec.Meta(max_length=MAX_PATH)]
    """Nodes it has passed, the sender last; none of them is chosen again."""
    timeout_ms: Annotated[int, msgspec.Meta(gt=0, le=int(MAX_DELIVERY_S * 1000))]
    """Time left for the whole delivery, the target's work included."""


class Delivered(msgspec.Struct, frozen=True, tag="delivered", forbid_unknown_fields=True):
    """The target's signed result envelope."""

    result: Annotated[bytes, msgspec.Meta(max_length=MAX_RESULT)]


class Undeliverable(msgspec.Struct, frozen=True, tag="undeliverable", forbid_unknown_fields=True):
    """The envelope did not reach its target (or its answer did not come back)."""

    reason: Annotated[str, msgspec.Meta(max_length=500)]


OwnerFrame = Deliver | Delivered | Undeliverable


class RelayError(MeshllmError):
    """An envelope could not be delivered; the message says where it stopped."""


def next_hops(own: str, target: str, connected: Collection[str], links: Mapping[str, Iterable[str]],
              avoid: Collection[str] = ()) -> list[str]:
    """Connected peers to hand an envelope for ``target`` to, best first (sans-IO).

    ``links`` maps a node to the peers it reports being connected to (its record's RTT row); links
    count both ways. The target itself comes first when connected; then connected peers by their
    hop distance to the target, nearest first (ties by node id), never one in ``avoid`` (the path
    so far). Peers with no known path to the target are not returned.
    """
    if target in connected:
        return [target]
    graph: dict[str, set[str]] = {}
    for node, peers in links.items():
        for peer in peers:
            if node != peer:
                graph.setdefault(node, set()).add(peer)
                graph.setdefault(peer, set()).add(node)
    blocked = {own, *avoid}
    distance = {target: 0}
    queue = deque([target])
    while queue:
        node = queue.popleft()
        for peer in sorted(graph.get(node, ())):
            if peer not in distance and peer not in blocked:
                distance[peer] = distance[node] + 1
                queue.append(peer)
    hops = [p for p in connected if p in distance and p not in blocked]
    return sorted(hops, key=lambda p: (distance[p], p))


Execute = Callable[[bytes, float], Awaitable[bytes]]
"""``execute(envelope, timeout_s)``: run a command addressed to this node; the result envelope."""


class OwnerRelay:
    """The ``owner`` stream handler and :meth:`deliver`, over one node's mesh service."""

    def __init__(self, mesh: MeshService, execute: Execute, on_event: Callable[..., None]) -> None:
        assert mesh.endpoint is not None and mesh.gossip is not None, "start the mesh service first"
        self.mesh = mesh
        self.node_id = mesh.node_id
        self._execute = execute
        self._on_event = on_event
        self._rate: RateLimit[str] = RateLimit(RATE_PER_S, RATE_BURST)
        self._in_flight: dict[str, int] = {}
        mesh.endpoint.on_stream(STREAM_KIND, self._serve, max_frame=FRAME_MAX)

    async def deliver(self, envelope: bytes, target: str, timeout_s: float, hops: int = MAX_HOPS,
                      path: tuple[str, ...] = ()) -> bytes:
        """The result envelope of ``envelope`` from ``target``; :class:`RelayError` if it did not get there."""
        timeout_s = min(timeout_s, MAX_DELIVERY_S)
        if target == self.node_id:
            return await self._execute(envelope, timeout_s)
        if hops <= 0:
            raise RelayError(f"hop limit reached at {short(self.node_id)} on the way to {short(target)}")
        deadline = time.monotonic() + timeout_s
        frame = Deliver(envelope, target, hops - 1, [*path, self.node_id][-MAX_PATH:], 1)
        errors = []
        for hop in self._candidates(target, path)[:MAX_ATTEMPTS]:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            try:
                stream = await self._open(hop, deadline)
                return await self._exchange(stream, msgspec.structs.replace(frame, timeout_ms=max(1, int(left * 1000))),
                                            hop, left)
            except (MeshllmError, OSError) as exc:
                # the next hop may do; if this one did deliver and only its answer was lost, a second
                # copy is refused at the target as a replay, so a command never runs twice
                errors.append(f"{short(hop)}: {exc}")
        why = "; ".join(errors) or "no known path and no address"
        raise RelayError(f"cannot reach node {short(target)} from {short(self.node_id)} ({why})")

    def _candidates(self, target: str, path: Iterable[str]) -> list[str]:
        """Connected next hops on known paths, then the target itself (dialed), then, when no path is
        known (gossip may not have told us yet), the other connected peers, which may be connected to it."""
        assert self.mesh.endpoint is not None and self.mesh.gossip is not None
        gossip = self.mesh.gossip
        connected = [n for n, c in self.mesh.endpoint.peers.items() if c.state != "suspect" and not c.passive]
        links = {n: list(e.record.rtt) for n, e in gossip.state.peers.items() if e.status == "alive"}
        links[self.node_id] = connected
        avoid = set(path)
        hops = next_hops(self.node_id, target, connected, links, avoid)
        if target in hops:
            return hops
        rest = [] if hops else sorted(n for n in connected if n not in avoid)
        return [*hops, target, *rest]

    async def _open(self, hop: str, deadline: float) -> Stream:
        assert self.mesh.endpoint is not None and self.mesh.gossip is not None
        entry = self.mesh.gossip.state.peers.get(hop)
        addrs = [] if entry is None else [*entry.record.addresses.listen, *entry.record.addresses.observed]
        if hop not in self.mesh.endpoint.peers and not addrs:
            raise RelayError("not connected and no address known")
        conn = await self.mesh.endpoint.connect_node(
            hop, addrs, min(CONNECT_TIMEOUT_S, max(0.1, deadline - time.monotonic())))
        return await conn.open_stream(STREAM_KIND, max_frame=FRAME_MAX)

    async def _exchange(self, stream: Stream, frame: Deliver, hop: str, timeout_s: float) -> bytes:
        """Send one Deliver on ``stream`` and read its one answer, all within ``timeout_s``."""
        try:
            await stream.send(frame, timeout=min(SEND_TIMEOUT_S, timeout_s))
            answer = await stream.recv(OwnerFrame, timeout=max(0.1, timeout_s))
        except NetTimeout:
            stream.reset()
            raise RelayError(f"node {short(hop)} did not answer within {timeout_s:.0f} s") from None
        except StreamClosed as exc:
            raise RelayError(f"node {short(hop)} dropped the envelope ({exc})") from None
        finally:
            with contextlib.suppress(StreamClosed):
                stream.close()
        if isinstance(answer, Delivered):
            return answer.result
        if isinstance(answer, Undeliverable):
            raise RelayError(f"via {short(hop)}: {answer.reason}")
        raise RelayError(f"node {short(hop)} answered with {'nothing' if answer is None else 'a Deliver frame'}")

    async def _serve(self, stream: Stream, conn: PeerConnection) -> None:
        """One envelope from a peer: execute it (ours) or carry it on, then answer once."""
        peer = conn.node_id or ""
        if not self._rate.allow(peer, time.monotonic()):
            conn.strike("owner envelopes faster than allowed")
            await _answer(stream, Undeliverable("too many owner envelopes from you; slow down"))
            return
        try:
            frame = await stream.recv(OwnerFrame, timeout=REQUEST_TIMEOUT_S)
        except NetTimeout as exc:
            stream.fail(ResetCode.TIMEOUT, str(exc))
            return
        if frame is None:
            return
        if not isinstance(frame, Deliver):
            stream.fail(ResetCode.BAD_FRAME, "an owner stream starts with a Deliver frame")
            return
        try:
            if envelope_target(frame.envelope) != frame.target:
                raise DecodeError("the envelope is addressed to another node than the frame names")
        except DecodeError as exc:
            conn.strike(f"malformed owner envelope: {exc}")
            await _answer(stream, Undeliverable(f"refused: {exc}"))
            return
        if self._in_flight.get(peer, 0) >= IN_FLIGHT_PER_PEER or sum(self._in_flight.values()) >= IN_FLIGHT_TOTAL:
            await _answer(stream, Undeliverable(f"node {short(self.node_id)} is relaying too many envelopes"))
            return
        self._in_flight[peer] = self._in_flight.get(peer, 0) + 1
        try:
            result = await self.deliver(frame.envelope, frame.target, frame.timeout_ms / 1000, frame.hops,
                                        (*frame.path, peer))
            await _answer(stream, Delivered(result))
        except RelayError as exc:
            await _answer(stream, Undeliverable(str(exc)[:500]))
        finally:
            left = self._in_flight.get(peer, 1) - 1
            if left:
                self._in_flight[peer] = left
            else:
                self._in_flight.pop(peer, None)
        if frame.target != self.node_id:
            self._on_event("owner_relayed", target=frame.target, source=peer)


async def _answer(stream: Stream, frame: OwnerFrame) -> None:
    with contextlib.suppress(StreamClosed, NetTimeout):
        await stream.send(frame, timeout=SEND_TIMEOUT_S)
