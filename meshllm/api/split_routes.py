"""``GET /api/plan?model=REF[&stages=N][&max_memory_gb=X]``: the chain the planner would choose now.

It plans over the node's own view of the mesh (gossiped capacities, roles and the RTT matrix) without
placing anything, so ``meshllm plan`` can show what ``serve --split`` would do and why.
"""

from __future__ import annotations

from typing import Any, Protocol

from fastapi import APIRouter, Depends, Query
from fastapi.responses import JSONResponse

from meshllm.api.auth import require_api_key
from meshllm.errors import MeshllmError
from meshllm.runtime.errors import error_body
from meshllm.split.planner import GIB


class PlanSource(Protocol):
    def plan_json(self, spec: str, stages: int | None, max_memory: int | None) -> dict[str, Any]:
        """The plan for model ``spec``; raises MeshllmError when none fits or the model is unknown."""
        ...


def plan_router(source: PlanSource) -> APIRouter:
    """The plan route, bound to the node's split service."""
    router = APIRouter()

    @router.get("/api/plan", response_model=None, dependencies=[Depends(require_api_key)])
    def get_plan(model: str = Query(min_length=1, max_length=4096), stages: int | None = Query(None, ge=1, le=8),
                 max_memory_gb: float | None = Query(None, gt=0, lt=1e6)) -> dict[str, Any] | JSONResponse:
        cap = int(max_memory_gb * GIB) if max_memory_gb else None
        try:
            return source.plan_json(model, stages, cap)
        except MeshllmError as exc:  # unknown model, nothing fits
            message = f"{exc} ({exc.hint})" if exc.hint else str(exc)
            return JSONResponse(error_body(message, "invalid_request_error", "no_plan"), status_code=422)

    return router
