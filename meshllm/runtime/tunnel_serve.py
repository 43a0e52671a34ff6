"""The serving end of the request tunnel: run requests peers route to this node on its engines.

One handler call per incoming ``"request"`` stream. The generation runs in its own task while a
watcher reads the caller's side: a :class:`~meshllm.runtime.tunnel.CancelFrame`, a reset, or the
caller closing its side before the response ended all mean nobody is listening, so the
generation is cancelled (the engine stops between two tokens). A node with all its peer slots
busy answers 503 at once, so the caller fails over instead of queueing here.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field

from meshllm.engine.base import EmbedRequest, Engine, Unsupported
from meshllm.engine.embed import embed_stream
from meshllm.engine.recommended import admit
from meshllm.identity.ids import short
from meshllm.net.connection import PeerConnection
from meshllm.net.errors import NetTimeout, StreamClosed
from meshllm.net.streams import Stream
from meshllm.runtime.counters import RequestCounters
from meshllm.runtime.errors import NoCapacity, UpstreamTimeout
from meshllm.runtime.tunnel import CallerFrame, ModelMismatch, Routable, TunnelEvent, TunnelServer
from meshllm.tasks import task_group

log = logging.getLogger(__name__)

REQUEST_TIMEOUT_S = 5.0
"""How long a caller may take to send its request frame after opening the stream."""
SEND_TIMEOUT_S = 30.0
"""How long one response frame may wait for the caller to read (a stalled caller is dropped)."""


PEER_SLOTS = 64
"""Requests peers may run on this node at once, by default (over it a peer's request gets 503 and fails over)."""


class Slots:
    """A counting limit that never waits: a full node refuses at once, so the caller fails over."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.active = 0

    def try_take(self) -> bool:
        """Take a slot if one is free."""
        if self.active >= self.limit:
            return False
        self.active += 1
        return True

    def give_back(self) -> None:
        """Return a slot taken with :meth:`try_take`."""
        self.active -= 1


@dataclass
class TunnelService:
    """Serves tunnel streams from peers with this node's engines."""

    engines: Mapping[str, Engine]
    slots: Slots
    counters: RequestCounters
    hashes: Mapping[str, str] = field(default_factory=dict)
    """sha256 of each engine's model file by model id (the live dict; a file still being hashed is absent)."""

    async def handle(self, stream: Stream, conn: PeerConnection) -> None:
        """The endpoint's handler for ``"request"`` streams (it closes the stream when we return)."""
        server = TunnelServer()
        frame = await stream.recv(CallerFrame, timeout=REQUEST_TIMEOUT_S)
        if frame is None:
            return
        server.receive(frame)  # a first frame that is not a request raises: the stream is reset
        assert server.request is not None
        request = server.request.request
        engine = self.engines.get(request.model)
        if engine is None:  # the caller's view of our record is stale (an unload): a 503 lets it fail over
            await stream.send(server.error(NoCapacity(f"model {request.model!r} is not served by this node now")))
            return
        server.model_sha256 = self.hashes.get(request.model, "")
        wanted = server.request.model_sha256
        if wanted and wanted != server.model_sha256:
            have = f"sha256 {server.model_sha256[:12]}" if server.model_sha256 else "a file not yet hashed"
            await stream.send(server.error(ModelMismatch(
                f"this node serves {request.model!r} from {have}, not {wanted[:12]}")))
            return
        if not self.slots.try_take():
            await stream.send(server.error(NoCapacity(f"all {self.slots.limit} peer request slots are busy")))
            return
        self.counters.served_for_peers += 1
        try:
            async with task_group() as group:
                work = group.create_task(self._generate(engine, request, stream, server,
                                                        server.request.deadline_ms / 1000))
                watch = group.create_task(self._watch(stream, server))
                await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
                if not work.done() and not server.done:
                    work.cancel()  # the caller left first: the engine stops between two tokens
                watch.cancel()
        finally:
            self.slots.give_back()
        log.debug("served a %s request for %s (cancelled: %s)", request.model, short(conn.node_id or "?"),
                  server.cancelled)

    @staticmethod
    async def _generate(engine: Engine, request: Routable, stream: Stream, server: TunnelServer,
                        deadline_s: float) -> None:
        if isinstance(request, EmbedRequest):
            events: AsyncIterator[TunnelEvent] = embed_stream(engine, request)
        else:
            try:
                request = admit(engine, request)
            except Unsupported as exc:
                await stream.send(server.error(exc), timeout=SEND_TIMEOUT_S)
                return
            events = engine.generate(request)
        try:
            async with asyncio.timeout(deadline_s):
                async for event in events:
                    await stream.send(server.event(event), timeout=SEND_TIMEOUT_S)
        except (StreamClosed, NetTimeout):
            return  # the caller is gone or stalled: nobody to tell
        except Exception as exc:
            if isinstance(exc, TimeoutError):
                exc = UpstreamTimeout(f"the request did not finish within its {deadline_s:g}s deadline")
            if not server.done:
                with contextlib.suppress(StreamClosed, NetTimeout):
                    await stream.send(server.error(exc), timeout=SEND_TIMEOUT_S)
        finally:
            close = getattr(events, "aclose", None)
            if close is not None:
                await close()

    @staticmethod
    async def _watch(stream: Stream, server: TunnelServer) -> None:
        """Return when the caller cancels, resets, or closes its side: nobody reads the response."""
        with contextlib.suppress(StreamClosed):
            while (frame := await stream.recv(CallerFrame, timeout=None)) is not None:
                server.receive(frame)
                if server.cancelled:
                    return

