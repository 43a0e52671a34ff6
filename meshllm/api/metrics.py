"""``GET /metrics``: the node's Prometheus registry (:mod:`meshllm.runtime.metrics`) over HTTP."""

from __future__ import annotations

from fastapi import APIRouter, Depends
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST

from meshllm.api.auth import require_admin
from meshllm.runtime.metrics import NodeMetrics


def metrics_router(metrics: NodeMetrics, public: bool = False) -> APIRouter:
    """``GET /metrics``; behind :func:`~meshllm.api.auth.require_admin` unless ``public``."""
    routes = APIRouter(tags=["node"], dependencies=[] if public else [Depends(require_admin)])

    @routes.get("/metrics", response_class=Response,
                responses={200: {"content": {CONTENT_TYPE_LATEST: {}}, "description": "Prometheus text format"}})
    async def metrics_text() -> Response:
        """The node's metrics in the Prometheus text format (docs/api.md, Metrics)."""
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    return routes
