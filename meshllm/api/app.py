"""The FastAPI application: OpenAI routes and ``/health`` around a :class:`Backend`, with limits."""

from __future__ import annotations

from collections.abc import Sequence

from fastapi import APIRouter, FastAPI

from meshllm import __version__
from meshllm.api import anthropic, embeddings, model_list, openai_chat, openai_completions, responses
from meshllm.api.backend import Backend, LocalBackend, ModelEntry
from meshllm.api.errors import install_error_handlers
from meshllm.api.limits import Admission, ApiLimits, BodyLimit

__all__ = ["ApiLimits", "Backend", "LocalBackend", "ModelEntry", "create_app"]


def create_app(backend: Backend, limits: ApiLimits | None = None, routers: Sequence[APIRouter] = ()) -> FastAPI:
    """The node's HTTP API around ``backend``; ``routers`` adds the node's own routes (status, events)."""
    limits = limits or ApiLimits()
    app = FastAPI(title="meshllm", version=__version__,
                  description="OpenAI-compatible API of a meshllm node (see docs/api.md).")
    admission = Admission(limits.max_concurrent, limits.queue_timeout_s)
    app.state.admission = admission
    app.state.backend = backend
    install_error_handlers(app)
    app.include_router(model_list.router(backend))
    app.include_router(openai_chat.router(backend, admission))
    app.include_router(openai_completions.router(backend, admission))
    app.include_router(embeddings.router(backend, admission))
    app.include_router(responses.router(backend, admission))
    app.include_router(anthropic.router(backend, admission))
    for router in routers:
        app.include_router(router)

    @app.get("/health", tags=["node"])
    async def health() -> dict[str, object]:
        """Liveness: the API answers; how many models the mesh serves; requests in progress."""
        return {"status": "ok", "models": len(backend.models()), "active_requests": admission.active}

    app.add_middleware(BodyLimit, limit=limits.max_body_bytes)
    return app
