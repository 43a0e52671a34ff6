"""The FastAPI application: OpenAI routes and ``/health`` around a :class:`Backend`, with limits and auth.

Layers a request passes, outermost first: :class:`~meshllm.api.edge.EdgeGuard` (the ``Host`` it
names, the web page that sends it), CORS, :class:`~meshllm.api.limits.BodyLimit` (size and time),
then the route, whose dependency (:mod:`meshllm.api.auth`) checks its secret. Connection counts and
header deadlines sit below all of these, in the HTTP protocol (:mod:`meshllm.api.connections`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from fastapi import APIRouter, Depends, FastAPI
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from meshllm import __version__
from meshllm.api import anthropic, embeddings, model_list, openai_chat, openai_completions, responses
from meshllm.api.auth import ApiAccess, audit_routes, document_access, require_api_key
from meshllm.api.edge import EdgePolicy, add_edge
from meshllm.api.errors import install_error_handlers
from meshllm.api.generation import ROUTED_HEADER
from meshllm.api.health import Readiness, health_router
from meshllm.api.limits import Admission, ApiLimits, BodyLimit, EdgeLimits
from meshllm.runtime.backend import Backend, LocalBackend, ModelEntry

__all__ = ["ApiAccess", "ApiLimits", "Backend", "EdgeLimits", "EdgePolicy", "LocalBackend", "ModelEntry",
           "Readiness", "create_app"]


def create_app(backend: Backend, limits: ApiLimits | None = None, routers: Sequence[APIRouter] = (), *,
               access: ApiAccess | None = None, edge: EdgeLimits | None = None, policy: EdgePolicy | None = None,
               readiness: Readiness | None = None, on_event: Callable[..., None] | None = None) -> FastAPI:
    """The node's HTTP API around ``backend``; ``routers`` adds the node's own routes (status, events, ...).

    Every ``/api/`` and ``/v1/`` route must carry a guard from :mod:`meshllm.api.auth` (checked here:
    an unguarded one is a :class:`~meshllm.errors.ConfigError`). Defaults suit tests: no API key,
    no admin token (management routes then refuse everyone), loopback host names only, and every
    model of ``backend`` counted as ready. ``on_event(type, **fields)`` hears what the routes decide
    (``auto_routed``).
    """
    limits = limits or ApiLimits()
    edge = edge or EdgeLimits()
    app = FastAPI(title="meshllm", version=__version__,
                  description="OpenAI-compatible API of a meshllm node (see docs/api.md).")
    admission = Admission(limits.max_concurrent, limits.queue_timeout_s)
    app.state.admission = admission
    app.state.backend = backend
    app.state.on_event = on_event
    app.state.access = access = access or ApiAccess()
    document_access(app, access)
    install_error_handlers(app)
    surfaces = APIRouter(dependencies=[Depends(require_api_key)])
    surfaces.include_router(model_list.router(backend))
    surfaces.include_router(openai_chat.router(backend, admission))
    surfaces.include_router(openai_completions.router(backend, admission))
    surfaces.include_router(embeddings.router(backend, admission))
    surfaces.include_router(responses.router(backend, admission))
    surfaces.include_router(anthropic.router(backend, admission))
    app.include_router(surfaces)
    for router in routers:
        app.include_router(router)
    readiness = readiness or Readiness(ready=True, models=[m.id for m in backend.models()])
    app.include_router(health_router(readiness, lambda: len(backend.models()), lambda: admission.active))
    audit_routes(app)
    app.add_middleware(BodyLimit, limit=limits.max_body_bytes, drain_limit=edge.max_drain_bytes,
                       timeout_s=edge.body_timeout_s)
    app.add_middleware(RoutedModelHeader)
    add_edge(app, policy or EdgePolicy())
    return app


class RoutedModelHeader:
    """Adds ``x-meshllm-routed-model`` to the response of a request the ``auto`` model routed (streamed or not)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_with_header(message: Message) -> None:
            state: dict[str, Any] = scope.get("state") or {}
            if message["type"] == "http.response.start" and state.get("routed_model"):
                headers = [*message.get("headers", []), (ROUTED_HEADER.encode(), str(state["routed_model"]).encode())]
                message = {**message, "headers": headers}
            await send(message)

        await self.app(scope, receive, send_with_header)
