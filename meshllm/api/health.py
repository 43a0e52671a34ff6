"""``GET /health``: whether the node is up, still starting, or leaving, and which of its models are ready.

A load balancer or a script needs more than "the API answers": while a node loads its models (or
places a split chain over workers), requests for them would fail, so ``/health`` answers 503 with
``status: "loading"`` until the node is ready, then 200 with ``status: "ok"``; 503
``"stopping"`` once it leaves. :class:`Readiness` learns all of it from the node's events, by their
types (:mod:`meshllm.events`), so no part of the node has to report to it directly.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from meshllm.api.auth import may_read
from meshllm.events import ModelLoadingEvent, ModelReadyEvent, NodeEvent, Ready, Stopping


class Readiness:
    """The node's start-up state and its models' state, fed by :meth:`on_event` (an EventHub sink)."""

    def __init__(self, ready: bool = False, models: Iterable[str] = ()) -> None:
        self.ready = ready
        self.stopping = False
        self.loading: set[str] = set()
        self.ready_models: set[str] = set(models)

    def on_event(self, event: NodeEvent) -> None:
        """Follow models on their way (:class:`ModelLoadingEvent`) and ready (:class:`ModelReadyEvent`),
        and the node's :class:`Ready` and :class:`Stopping`."""
        if isinstance(event, ModelLoadingEvent) and isinstance(event.model, str):
            self.loading.add(event.model)
            self.ready_models.discard(event.model)
        elif isinstance(event, ModelReadyEvent) and isinstance(event.model, str):
            self.loading.discard(event.model)
            self.ready_models.add(event.model)
        elif isinstance(event, Ready):
            self.ready = True
        elif isinstance(event, Stopping):
            self.stopping = True

    @property
    def status(self) -> str:
        return "stopping" if self.stopping else "ok" if self.ready else "loading"


def health_router(readiness: Readiness, mesh_models: Callable[[], int], active: Callable[[], int]) -> APIRouter:
    """``/health``, open to anyone: probes need no secret. On a node with API keys, a caller without
    one sees only ``status`` (the model names and counts are for clients of the API)."""
    router = APIRouter()

    @router.get("/health", tags=["node"], response_model=None)
    async def health(request: Request) -> JSONResponse:
        """200 when ready; 503 while loading or stopping. Models served here ready/loading; mesh models; requests."""
        status = readiness.status
        code = 200 if status == "ok" else 503
        if not may_read(request):
            return JSONResponse({"status": status}, status_code=code)
        body = {"status": status, "models": mesh_models(), "active_requests": active(),
                "ready_models": sorted(readiness.ready_models), "loading": sorted(readiness.loading)}
        return JSONResponse(body, status_code=code)

    return router
