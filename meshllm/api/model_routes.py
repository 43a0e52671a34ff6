"""The model library over HTTP: ``GET /api/models``, ``POST /api/models/pull``, ``DELETE /api/models/{ref}``.

``meshllm models`` calls these when it is given ``--api``: the running node then does the work (a
pull it starts shows in ``/api/status`` ``transfers`` and as events) and its peer record follows
what its library holds. Changing the library needs the admin token.
"""

from __future__ import annotations

import asyncio
from typing import Any

import msgspec
from fastapi import APIRouter, Depends, Path
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field

from meshllm.api.auth import require_admin, require_api_key
from meshllm.errors import MeshllmError
from meshllm.models.library import LibraryEntry
from meshllm.models.store import ModelStore
from meshllm.runtime.errors import error_body


class PullBody(BaseModel):
    ref: str = Field(min_length=1, max_length=4096, description="hf:ORG/REPO/FILE.gguf, hf:ORG/REPO:QUANT, or a "
                                                                 "name or id a peer offers")


def entry_json(entry: LibraryEntry) -> dict[str, Any]:
    data = msgspec.to_builtins(entry)
    data["layers"] = list(entry.layers) if entry.layers else None
    data["disk_bytes"] = entry.disk_bytes()
    return data


def models_router(store: ModelStore, resolve: Any) -> APIRouter:
    """Routes over the node's store; ``resolve(ref)`` is the node's own ``--model`` resolution (async)."""
    router = APIRouter()

    @router.get("/api/models", dependencies=[Depends(require_api_key)])
    async def listing() -> dict[str, Any]:
        library = store.library
        entries = await asyncio.to_thread(library.entries)
        return {"library": [entry_json(e) for e in entries], "disk_bytes": await asyncio.to_thread(library.disk_bytes),
                "budget_bytes": library.budget_bytes,
                "mesh": [msgspec.to_builtins(o) for o in store.catalog()]}

    @router.post("/api/models/pull", response_model=None, dependencies=[Depends(require_admin)])
    async def pull(body: PullBody) -> dict[str, Any] | JSONResponse:
        try:
            ref = await resolve(body.ref)
        except MeshllmError as exc:
            return _refused(exc, 422)
        entry = store.library.find(ref.sha256) if ref.sha256 else None
        return {"id": ref.sha256, "name": ref.model_id, "path": str(ref.path),
                "entry": entry_json(entry) if entry else None}

    @router.delete("/api/models/{ref}", response_model=None, dependencies=[Depends(require_admin)])
    async def remove(ref: str = Path(min_length=1, max_length=300)) -> dict[str, Any] | JSONResponse:
        target = store.library.find(ref)
        if target is not None and any(k.startswith(target.id) for k in store.library.pinned):
            return _refused(MeshllmError(f"{target.name}@{target.short} is in use by this node",
                                         hint="stop serving it first"), 409)
        removed = await asyncio.to_thread(store.library.remove, ref)
        if not removed:
            return _refused(MeshllmError(f"no model {ref!r} in this node's library"), 422)
        store.changed()
        return {"removed": [entry_json(e) | {"deleted": e.owned} for e in removed]}

    return router


def _refused(exc: MeshllmError, status: int) -> JSONResponse:
    message = f"{exc} ({exc.hint})" if exc.hint else str(exc)
    return JSONResponse(error_body(message, "invalid_request_error", "model_not_found" if status == 422
                                   else "model_in_use"), status_code=status)
