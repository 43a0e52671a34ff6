"""Node management routes: ``/health``-adjacent status, the event stream, and invites.

``GET /api/status`` is the snapshot ``meshllm status`` draws (schema in docs/api.md);
``GET /api/events`` streams the node's events as server-sent events; ``POST /api/invite`` asks the
node for a fresh invite token and ``POST /api/revoke`` revokes an invite or a node id and gossips
the revocation to every member (only the node holding the mesh key can sign either).

The two reads need an API key once the node has one; invites and revocations always need the
admin token or an API key (:mod:`meshllm.api.auth`).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Iterable
from typing import Any, Literal, Protocol

import msgspec
from fastapi import APIRouter, Depends
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, Field

from meshllm.api.auth import require_admin, require_api_key
from meshllm.errors import ConfigError, DecodeError, MeshllmError
from meshllm.events import EventHub
from meshllm.mesh.admission import inspect_token
from meshllm.mesh.records import PeerRecord
from meshllm.runtime.errors import error_body

KEEPALIVE_S = 15.0


class StatusSource(Protocol):
    """What the routes need from the node."""

    events: EventHub

    def status(self) -> dict[str, Any]:
        """The ``/api/status`` snapshot."""
        ...

    def create_invite(self, ttl_s: float, max_uses: int) -> str:
        """A fresh invite token; raises MeshllmError when this node cannot sign one."""
        ...

    def revoke(self, kind: Literal["invite", "node"], target: str) -> dict[str, Any]:
        """Revoke and gossip; ConfigError when not the mesh owner, DecodeError on a bad target."""
        ...


class InviteRequest(BaseModel):
    """Body of ``POST /api/invite``."""

    ttl_s: float = Field(default=24 * 3600.0, gt=0, le=365 * 86400.0)
    max_uses: int = Field(default=1, ge=0, le=1_000_000)


class RevokeRequest(BaseModel):
    """Body of ``POST /api/revoke``."""

    kind: Literal["invite", "node"]
    target: str = Field(min_length=1, max_length=200)


def status_router(node: StatusSource) -> APIRouter:
    """Routes for status, events and invites, bound to ``node``."""
    router = APIRouter()

    @router.get("/api/status", dependencies=[Depends(require_api_key)])
    async def get_status() -> Response:
        # On the event loop, which owns what the snapshot reads (a worker thread read it mid-change), and
        # encoded by msgspec rather than FastAPI's recursive encoder: 50 members read at once every 0.2 s
        # had starved their own probes into false downs; a call now costs a 50-member node 5.5 ms of CPU
        # (docs/benchmarks.md).
        return Response(msgspec.json.encode(node.status()), media_type="application/json")

    @router.get("/api/events", dependencies=[Depends(require_api_key)])
    async def get_events() -> StreamingResponse:
        return StreamingResponse(_sse(node.events), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})

    @router.post("/api/invite", response_model=None, dependencies=[Depends(require_admin)])
    def post_invite(body: InviteRequest) -> dict[str, Any] | JSONResponse:
        try:
            token = node.create_invite(body.ttl_s, body.max_uses)
        except MeshllmError as exc:  # this node does not hold the mesh key
            message = f"{exc} ({exc.hint})" if exc.hint else str(exc)
            return JSONResponse(error_body(message, "invalid_request_error", "not_mesh_owner"), status_code=409)
        invite = inspect_token(token)  # the id and expiry, so a caller can list and revoke what it made
        return {"token": token, "invite_id": invite.invite_id, "expires": invite.expires,
                "max_uses": invite.max_uses}

    @router.post("/api/revoke", response_model=None, dependencies=[Depends(require_admin)])
    async def post_revoke(body: RevokeRequest) -> dict[str, Any] | JSONResponse:
        # async on purpose: the revocation changes the gossip core, which lives on this event loop.
        try:
            return node.revoke(body.kind, body.target)
        except ConfigError as exc:  # this node does not hold the mesh key
            return JSONResponse(error_body(_text(exc), "invalid_request_error", "not_mesh_owner"), status_code=409)
        except DecodeError as exc:
            return JSONResponse(error_body(_text(exc), "invalid_request_error", "invalid_target", "target"),
                                status_code=422)

    return router


PATH_NAMES = {"direct": "direct", "punched": "punched", "relay": "relayed"}
"""Record path kinds under the names ``/api/status`` uses for connections."""
PATH_PREFERENCE = ("direct", "punched", "relayed")
"""When the two ends of a link report different paths, the better one is the newer (traffic moves up)."""


def mesh_links(records: Iterable[PeerRecord]) -> list[dict[str, Any]]:
    """``/api/status`` ``links``: every measured link between the given nodes, once per pair.

    Each node's record carries the RTT and path to the peers it is connected to; a link is kept when
    either end measured it, with the mean RTT of both ends' figures. The console draws the mesh map
    from this, so it can colour links this node is not part of.
    """
    recs = list(records)
    known = {r.node_id for r in recs}
    seen: dict[tuple[str, str], list[tuple[float, str]]] = {}
    for rec in recs:
        for peer, entry in rec.rtt.items():
            if peer in known and peer != rec.node_id:
                pair = (min(rec.node_id, peer), max(rec.node_id, peer))
                seen.setdefault(pair, []).append((entry.rtt_ms, PATH_NAMES.get(entry.path, entry.path)))
    links = []
    for (a, b), measured in sorted(seen.items()):
        path = min((p for _, p in measured), key=lambda p: PATH_PREFERENCE.index(p) if p in PATH_PREFERENCE else 9)
        links.append({"a": a, "b": b, "rtt_ms": round(sum(ms for ms, _ in measured) / len(measured), 3),
                      "path": path})
    return links


def _text(exc: MeshllmError) -> str:
    return f"{exc} ({exc.hint})" if exc.hint else str(exc)


async def _sse(hub: EventHub) -> AsyncIterator[str]:
    """Recent history first, then live events; a comment line every 15 s keeps proxies from timing out."""
    # Subscribe before reading the history, in one step of the loop: an event published while the
    # history is being sent is then in the live stream, not lost between the two.
    events = hub.subscribe()
    history = hub.recent()
    pending: asyncio.Future[dict[str, Any]] | None = None
    try:
        for event in history:
            yield _frame(event.wire())
        while True:
            # Wait on one pending read across keep-alives rather than starting a new one each time.
            pending = pending or asyncio.ensure_future(anext(events))
            done, _ = await asyncio.wait({pending}, timeout=KEEPALIVE_S)
            if not done:
                yield ": keepalive\n\n"
                continue
            event, pending = pending.result(), None
            yield _frame(event.wire())
    finally:
        if pending is not None:
            pending.cancel()
        await events.aclose()


def _frame(event: dict[str, Any]) -> str:
    return f"event: {event['type']}\ndata: {json.dumps(event, default=str, separators=(',', ':'))}\n\n"
