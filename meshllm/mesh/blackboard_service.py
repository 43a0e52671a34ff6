"""The blackboard's asyncio driver: moves :mod:`.blackboard` messages over ``blackboard`` streams.

One message per stream, as gossip does; the peers are the mesh endpoint's admitted connections,
so a note reaches only members, and every note is checked against the same admission and trust
rules as a peer record (:meth:`RecordVerifier.check_credential`). What the core decides is reported
through ``on_event``: ``note_posted`` (here), ``note_received`` (from a peer) and ``note_refused``
(with the refusal's code and reason).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from typing import Any

import msgspec

from meshllm.errors import DecodeError, MeshllmError, VerificationError
from meshllm.identity.certs import verify_certificate
from meshllm.identity.ids import b32
from meshllm.mesh.blackboard import Accepted, Blackboard, BoardMessage, HeldNote, Output, Query, Refused, Send
from meshllm.mesh.failure import Overstep
from meshllm.mesh.service import MeshService
from meshllm.net.errors import NetTimeout
from meshllm.net.events import PeerEvent, PeerEventKind
from meshllm.net.messages import ResetCode
from meshllm.tasks import spawn

log = logging.getLogger(__name__)

STREAM_KIND = "blackboard"
SEND_TIMEOUT_S = 5.0
RECV_TIMEOUT_S = 10.0
TICK_S = 10.0
"""How often expired notes are dropped."""


class BlackboardService:
    """The node's blackboard: post and search here, kept in step with every member."""

    def __init__(self, mesh: MeshService, on_event: Callable[..., None]) -> None:
        assert mesh.endpoint is not None and mesh.gossip is not None, "start the mesh service first"
        self.mesh = mesh
        self._on_event = on_event
        self.core = Blackboard(mesh.node_id, mesh.membership.mesh_id, self._check_author)
        self._tasks: set[asyncio.Task[Any]] = set()
        self._ticker: asyncio.Task[None] | None = None
        mesh.endpoint.on_stream(STREAM_KIND, self._serve)
        self._unsubscribe = mesh.endpoint.on_peer_event(self._on_peer_event)
        for peer in list(mesh.endpoint.peers):
            self._handle(self.core.peer_connected(peer))

    def start(self) -> None:
        self._ticker = asyncio.create_task(self._tick(), name="blackboard-expiry")

    async def stop(self) -> None:
        self._unsubscribe()
        for task in [self._ticker, *self._tasks]:
            if task is not None:
                task.cancel()

    def post(self, text: str) -> HeldNote:
        """Scrub, sign and spread a note; :class:`~meshllm.mesh.blackboard.BoardRefusal` when it may not go."""
        assert self.mesh.gossip is not None
        own = self.mesh.gossip.own
        held, out = self.core.post(self.mesh.key.signing_key, text, own.name, own.membership_proof, own.owner_cert,
                                   time.time())
        self._handle(out)
        return held

    def search(self, query: Query) -> list[HeldNote]:
        return self.core.search(query, time.time())

    # -- internals ------------------------------------------------------------------------------

    def _check_author(self, node_id: str, proof: bytes, cert: bytes | None, now: float) -> str | None:
        """The record rules (membership, trust policy); the certifying owner's key when the certificate holds."""
        self.mesh.verifier.check_credential(node_id, proof, cert, now)
        if cert is None:
            return None
        try:
            return b32(verify_certificate(cert, node_id, now).owner_pub)
        except (DecodeError, VerificationError):
            return None  # the trust policy let an uncertified node in: it names no owner

    def _handle(self, outputs: list[Output]) -> None:
        for out in outputs:
            if isinstance(out, Send):
                spawn(self._tasks, self._send(out.to, out.message))
            elif isinstance(out, Accepted):
                note = out.note
                kind = "note_posted" if out.source is None else "note_received"
                self._on_event(kind, id=note.id.hex(), author=note.note.author, name=note.note.name,
                               **({} if out.source is None else {"source": out.source}))
            elif isinstance(out, Refused):
                log.warning("refused a blackboard note from %s: %s (%s)", out.source[:8], out.code, out.reason)
                self._on_event("note_refused", source=out.source, author=out.author, code=out.code,
                               reason=out.reason)
            elif isinstance(out, Overstep):
                conn = self.mesh.endpoint.peers.get(out.peer) if self.mesh.endpoint is not None else None
                if conn is not None:
                    conn.strike(out.reason)

    def _on_peer_event(self, event: PeerEvent) -> None:
        conn = self.mesh.endpoint.peers.get(event.node_id) if self.mesh.endpoint is not None else None
        if conn is not None and conn.passive:
            return  # a passive client holds no board (it runs no blackboard service)
        if event.kind is PeerEventKind.CONNECTED:
            self._handle(self.core.peer_connected(event.node_id))
        elif event.kind is PeerEventKind.CLOSED:
            self.core.peer_disconnected(event.node_id)

    async def _tick(self) -> None:
        while True:
            await asyncio.sleep(TICK_S)
            self.core.tick(time.time())

    async def _send(self, to: str, message: BoardMessage) -> None:
        assert self.mesh.endpoint is not None
        conn = self.mesh.endpoint.peers.get(to)
        if conn is None:
            return
        stream = None
        try:
            stream = await conn.open_stream(STREAM_KIND)
            await stream.send(msgspec.Raw(msgspec.msgpack.encode(message)), timeout=SEND_TIMEOUT_S)
            stream.close()
            stream.discard_input()
            await stream.drain(timeout=SEND_TIMEOUT_S)
        except MeshllmError as exc:  # the peer went away or grants no credit: ids are announced again
            log.debug("blackboard send to %s failed: %s", to[:8], exc)
            if stream is not None:
                with contextlib.suppress(MeshllmError):
                    stream.reset()

    async def _serve(self, stream: Any, conn: Any) -> None:
        try:
            message = await stream.recv(BoardMessage, timeout=RECV_TIMEOUT_S)
        except NetTimeout as exc:
            stream.fail(ResetCode.TIMEOUT, str(exc))
            return
        if message is not None:
            self._handle(self.core.receive(conn.node_id, message, time.time()))
