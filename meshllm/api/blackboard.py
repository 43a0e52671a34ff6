"""``GET/POST /api/blackboard``: read and post the mesh blackboard (docs/api.md, "Blackboard").

``GET`` searches the notes this node holds (every member holds the same, give or take the time a
note takes to spread): ``q`` (words, and ``KIND:`` words), ``from`` (a node id, its prefix, or a
node name), ``since_s`` (notes signed in the last so many seconds), ``kind`` and ``limit``.
``POST {"text": ...}`` signs and spreads a note from this node; it needs the admin token or an API
key, as every route that speaks for the node does. A refusal is a 400 (``too-large``, ``empty``),
a 429 (``rate``), or a 409 (``passive-client``: a passive client holds no board), with the reason.
"""

from __future__ import annotations

import time
from typing import Any, Protocol

from fastapi import APIRouter, Depends, Query
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from meshllm.api.auth import require_admin, require_api_key
from meshllm.mesh import blackboard
from meshllm.mesh.blackboard import BoardRefusal, HeldNote, parse_words
from meshllm.runtime.errors import error_body


class Board(Protocol):
    """What the routes need of the node's blackboard (``mesh.blackboard_service.BlackboardService``)."""

    def post(self, text: str) -> HeldNote: ...
    def search(self, query: blackboard.Query) -> list[HeldNote]: ...


class PostNote(BaseModel):
    """Body of ``POST /api/blackboard``."""

    model_config = ConfigDict(extra="forbid")
    text: str = Field(min_length=1, max_length=64 * 1024)


def query_from(q: str = "", author: str | None = None, since_s: float | None = None, kind: str | None = None,
               limit: int = 20) -> blackboard.Query:
    """A search as the API, the CLI and the MCP tools phrase it (``since_s``: seconds back from now; beyond
    the notes' lifetime it changes nothing)."""
    words, word_kind = parse_words(q)
    since = None if since_s is None else time.time() - min(since_s, blackboard.LIFETIME_S)
    return blackboard.Query(words=words, author=author or None, kind=(kind or word_kind or None), since=since,
                            limit=limit)


def refusal_response(exc: BoardRefusal) -> JSONResponse:
    status = {"rate": 429, "passive-client": 409}.get(exc.code, 400)
    message = f"{exc} ({exc.hint})" if exc.hint else str(exc)
    return JSONResponse(error_body(message, "invalid_request_error", exc.code, "text"), status_code=status)


def blackboard_router(board: Board) -> APIRouter:
    router = APIRouter()

    @router.get("/api/blackboard", response_model=None, dependencies=[Depends(require_api_key)])
    async def get_notes(q: str = Query("", max_length=500),
                        author: str | None = Query(None, alias="from", max_length=64),
                        since_s: float | None = Query(None, ge=0, le=1e9),
                        kind: str | None = Query(None, pattern="(?i)^(" + "|".join(blackboard.KINDS) + ")$"),
                        limit: int = Query(20, ge=1, le=500)) -> dict[str, Any] | JSONResponse:
        try:
            notes = board.search(query_from(q, author, since_s, kind, limit))
        except BoardRefusal as exc:
            return refusal_response(exc)
        return {"notes": [n.json() for n in notes]}

    @router.post("/api/blackboard", response_model=None, dependencies=[Depends(require_admin)])
    async def post_note(body: PostNote) -> dict[str, Any] | JSONResponse:
        try:
            return board.post(body.text).json()
        except BoardRefusal as exc:
            return refusal_response(exc)

    return router
