"""HTTP routes for publishing a mesh and for the node's DHT presence.

``POST /api/publish {"name": ...}`` publishes (or renames) the mesh; ``POST /api/publish
{"off": true}`` and ``DELETE /api/publish`` withdraw it; ``GET /api/publish`` reports it.
``GET /api/dht`` gives the node's DHT multiaddrs, which ``meshllm discover`` on the same machine
uses as its bootstrap when it is given none. Only the mesh owner can publish (409 otherwise), and
only a caller with the node's admin token or an API key may ask it to (:mod:`meshllm.api.auth`).
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field

from meshllm.api.auth import require_admin, require_api_key
from meshllm.discovery.publisher import NodeDiscovery, NotMeshOwner
from meshllm.runtime.errors import error_body


class PublishRequest(BaseModel):
    """Body of ``POST /api/publish``."""

    name: str | None = Field(default=None, min_length=1, max_length=64)
    off: bool = False


def discovery_router(discovery: NodeDiscovery) -> APIRouter:
    """Routes bound to the node's :class:`NodeDiscovery`."""
    router = APIRouter()

    @router.get("/api/publish", dependencies=[Depends(require_api_key)])
    def get_publish() -> dict[str, Any]:
        return discovery.publish_info()

    @router.post("/api/publish", response_model=None, dependencies=[Depends(require_admin)])
    async def post_publish(body: PublishRequest) -> dict[str, Any] | JSONResponse:
        if body.off:
            return await discovery.unpublish()
        try:
            return await discovery.publish(body.name)
        except NotMeshOwner as exc:
            return JSONResponse(error_body(f"{exc} ({exc.hint})", "invalid_request_error", "not_mesh_owner"),
                                status_code=409)

    @router.delete("/api/publish", dependencies=[Depends(require_admin)])
    async def delete_publish() -> dict[str, Any]:
        return await discovery.unpublish()

    @router.get("/api/dht", dependencies=[Depends(require_api_key)])
    def get_dht() -> dict[str, Any]:
        return discovery.dht_info()

    return router
