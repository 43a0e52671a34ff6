"""``/v1/models``: every model the mesh serves, with the nodes serving it, and ``auto``."""

from __future__ import annotations

from fastapi import APIRouter

from meshllm.api.auto import AUTO
from meshllm.api.generation import ERROR_RESPONSES
from meshllm.api.schemas import ModelList, ModelOut
from meshllm.runtime.backend import Backend
from meshllm.runtime.errors import UnknownModel


def router(backend: Backend) -> APIRouter:
    """The model listing routes over ``backend``."""
    routes = APIRouter(prefix="/v1", tags=["openai"], responses=ERROR_RESPONSES)

    def model_list() -> list[ModelOut]:
        models = backend.models()
        listed = [ModelOut(id=m.id, created=m.created, nodes=list(m.nodes), node_names=list(m.node_names),
                           context_length=m.context_length)
                  for m in models]
        if not models:
            return listed
        # ``auto`` stands for whichever model fits a request (meshllm.api.auto); it holds the longest context
        longest = max((m.context_length for m in models if m.context_length), default=None)
        return [*listed, ModelOut(id=AUTO, created=min(m.created for m in models), context_length=longest)]

    @routes.get("/models", response_model=ModelList)
    async def list_models() -> ModelList:
        """Every model some node of the mesh serves, with the nodes serving it."""
        return ModelList(data=model_list())

    @routes.get("/models/{model_id:path}", response_model=ModelOut)
    async def get_model(model_id: str) -> ModelOut:
        """One model, or 404."""
        for entry in model_list():
            if entry.id == model_id:
                return entry
        raise UnknownModel(f"model {model_id!r} is not served by this mesh")

    return routes
