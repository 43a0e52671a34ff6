"""``POST /v1/embeddings``: pooled hidden states of a served model, routed across the mesh like chat.

``input`` is a string, token ids, or a list of either; each gets one L2-normalised vector
(``encoding_format: "base64"`` sends the float32 bytes, as OpenAI does). A model that cannot
embed (a split chain, the numpy runtime) is a 400 naming ``model``.
"""

from __future__ import annotations

import base64
from array import array
from typing import Annotated, Any, Literal

from fastapi import APIRouter
from pydantic import BaseModel, Field

from meshllm.api.generation import ERROR_RESPONSES
from meshllm.api.limits import Admission
from meshllm.api.schemas import RequestBody, TokenIds, clean
from meshllm.engine.base import EmbedRequest
from meshllm.engine.embed import MAX_INPUTS
from meshllm.runtime.backend import Backend
from meshllm.runtime.errors import BadRequest


class EmbeddingRequestIn(RequestBody):
    """``POST /v1/embeddings``."""

    model: str = Field(min_length=1, max_length=512)
    input: str | TokenIds | Annotated[list[str], Field(min_length=1, max_length=MAX_INPUTS)] | Annotated[
        list[TokenIds], Field(min_length=1, max_length=MAX_INPUTS)] = Field(
        description=f"a string, token ids, or a list of up to {MAX_INPUTS} of either")
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(default=None, ge=1, description="only the model's own width")
    user: str | None = Field(default=None, max_length=512)

    def to_engine(self) -> EmbedRequest:
        """The engine's request; an empty input is a 400 naming it."""
        raw = self.input
        items: list[str | tuple[int, ...]]
        if isinstance(raw, str):
            items = [clean(raw)]
        elif raw and all(isinstance(x, int) for x in raw):
            items = [tuple(raw)]  # type: ignore[arg-type]
        else:
            items = [clean(x) if isinstance(x, str) else tuple(x) for x in raw]  # type: ignore[union-attr]
        for i, item in enumerate(items):
            if isinstance(item, str) and not item:
                raise BadRequest(f"input[{i}] is an empty string", param="input")
        return EmbedRequest(model=self.model, inputs=tuple(items), user=clean(self.user) if self.user else None)


class EmbeddingOut(BaseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str


class EmbeddingUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingList(BaseModel):
    """The embeddings, in input order."""

    object: Literal["list"] = "list"
    data: list[EmbeddingOut]
    model: str
    usage: EmbeddingUsage


def router(backend: Backend, admission: Admission) -> APIRouter:
    """The embeddings route over ``backend``."""
    routes = APIRouter(prefix="/v1", tags=["openai"], responses=ERROR_RESPONSES)

    @routes.post("/embeddings", response_model=EmbeddingList)
    async def embeddings(body: EmbeddingRequestIn) -> dict[str, Any]:
        """One vector per input."""
        request = body.to_engine()
        await admission.acquire()
        try:
            result = await backend.embed(request)
        finally:
            admission.release()
        width = len(result.vectors[0]) // 4 if result.vectors else 0
        if body.dimensions is not None and body.dimensions != width:
            raise BadRequest(f"dimensions: model {body.model} makes {width}-dimensional embeddings "
                             "(shortening them is not supported)", param="dimensions")
        data = [{"object": "embedding", "index": i,
                 "embedding": base64.b64encode(v).decode() if body.encoding_format == "base64"
                 else array("f", v).tolist()} for i, v in enumerate(result.vectors)]
        return {"object": "list", "data": data, "model": body.model,
                "usage": {"prompt_tokens": result.prompt_tokens, "total_tokens": result.prompt_tokens}}

    return routes
