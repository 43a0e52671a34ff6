"""OpenAI routes: ``/v1/models``, ``/v1/chat/completions``, ``/v1/completions``.

Every generation waits for its *first* event before answering. That is what lets an error
discovered late (unknown model on the serving peer, a full queue, a prompt over the context)
still become a proper status code, and it is the point until which the backend may fail over
to another node. Once the first byte is sent, a failure can only be reported inside the stream.

Streams follow OpenAI's SSE format: ``data: <chunk json>`` events, then ``data: [DONE]``. When
the client goes away, the response's task is cancelled; closing the backend's iterator then
stops the generation wherever it runs. Non-streamed requests watch for the disconnect too, so
nobody generates for a client that has left.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import msgspec
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from meshllm.api.backend import Backend
from meshllm.api.errors import UnknownModel, UpstreamError, error_for
from meshllm.api.limits import Admission, client_key
from meshllm.api.schemas import (
    ChatCompletion,
    ChatCompletionRequest,
    Completion,
    CompletionRequestIn,
    ErrorResponse,
    ModelList,
    ModelOut,
)
from meshllm.engine.base import Finish, GenerationEvent, GenerationRequest, TextDelta, Usage

_ERROR = {"model": ErrorResponse}
ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    400: {**_ERROR, "description": "Bad request: invalid JSON or an unsupported parameter value"},
    404: {**_ERROR, "description": "Unknown model"},
    413: {**_ERROR, "description": "Request body too large"},
    422: {**_ERROR, "description": "A field is missing or has the wrong type or range"},
    429: {**_ERROR, "description": "Saturated: no place for this request now; retry after the Retry-After seconds"},
    502: {**_ERROR, "description": "The serving node failed"},
    503: {**_ERROR, "description": "No capacity: all slots or queues are full"},
    504: {**_ERROR, "description": "The serving node did not answer in time"},
}
_STREAM_DOC: dict[int | str, dict[str, Any]] = {
    200: {"content": {"text/event-stream": {
        "description": "with stream=true: one event per chunk (JSON in data), then data: [DONE]",
        "schema": {"type": "object", "required": ["data"], "properties": {"data": {"type": "string"}}}}}},
}


@dataclass(frozen=True)
class _Shape:
    """How one kind of completion renders its chunks and its full response."""

    chat: bool
    id: str
    model: str
    created: int
    echo: str = ""

    def _chunk(self, choice: dict[str, Any] | None, usage: Usage | None = None) -> dict[str, Any]:
        out: dict[str, Any] = {"id": self.id, "object": "chat.completion.chunk" if self.chat else "text_completion",
                               "created": self.created, "model": self.model,
                               "choices": [choice] if choice is not None else []}
        if usage is not None:
            out["usage"] = _usage(usage)
        return out

    def opening(self) -> list[dict[str, Any]]:
        """Chunks before the first text (chat announces the role; completion may echo)."""
        if self.chat:
            return [self._chunk({"index": 0, "delta": {"role": "assistant", "content": ""},
                                 "finish_reason": None, "logprobs": None})]
        return [self.text(self.echo)] if self.echo else []

    def text(self, text: str) -> dict[str, Any]:
        """A chunk carrying generated text."""
        if self.chat:
            return self._chunk({"index": 0, "delta": {"content": text}, "finish_reason": None, "logprobs": None})
        return self._chunk({"index": 0, "text": text, "finish_reason": None, "logprobs": None})

    def closing(self, finish: Finish, include_usage: bool) -> list[dict[str, Any]]:
        """The finish chunk, then (if asked) the usage chunk with no choices."""
        if self.chat:
            last = {"index": 0, "delta": {}, "finish_reason": finish.reason, "logprobs": None}
        else:
            last = {"index": 0, "text": "", "finish_reason": finish.reason, "logprobs": None}
        chunks = [self._chunk(last)]
        if include_usage:
            chunks.append(self._chunk(None, finish.usage))
        return chunks

    def whole(self, text: str, finish: Finish) -> dict[str, Any]:
        """The non-streamed response."""
        if self.chat:
            body = ChatCompletion.model_validate({
                "id": self.id, "created": self.created, "model": self.model, "usage": _usage(finish.usage),
                "choices": [{"message": {"content": text}, "finish_reason": finish.reason}]})
        else:
            body = Completion.model_validate({
                "id": self.id, "created": self.created, "model": self.model, "usage": _usage(finish.usage),
                "choices": [{"text": self.echo + text, "finish_reason": finish.reason}]})
        return body.model_dump()


def _usage(usage: Usage) -> dict[str, Any]:
    return {"prompt_tokens": usage.prompt_tokens, "completion_tokens": usage.completion_tokens,
            "total_tokens": usage.total_tokens, "prompt_tokens_details": {"cached_tokens": usage.cached_tokens}}


def _sse(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def build_router(backend: Backend, admission: Admission) -> APIRouter:
    """The ``/v1`` routes over ``backend``."""
    router = APIRouter(prefix="/v1", tags=["openai"], responses=ERROR_RESPONSES)

    def model_list() -> list[ModelOut]:
        return [ModelOut(id=m.id, created=m.created, nodes=list(m.nodes), node_names=list(m.node_names),
                         context_length=m.context_length)
                for m in backend.models()]

    @router.get("/models", response_model=ModelList)
    async def list_models() -> ModelList:
        """Every model some node of the mesh serves, with the nodes serving it."""
        return ModelList(data=model_list())

    @router.get("/models/{model_id:path}", response_model=ModelOut)
    async def get_model(model_id: str) -> ModelOut:
        """One model, or 404."""
        for entry in model_list():
            if entry.id == model_id:
                return entry
        raise UnknownModel(f"model {model_id!r} is not served by this mesh")

    @router.post("/chat/completions", response_model=ChatCompletion, responses=_STREAM_DOC)
    async def chat_completions(body: ChatCompletionRequest, http: Request) -> Response:
        """Chat completion; ``stream=true`` for SSE."""
        shape = _Shape(chat=True, id=f"chatcmpl-{uuid.uuid4().hex}", model=body.model, created=int(time.time()))
        return await serve(http, body.to_engine(), shape, body.stream, body.include_usage)

    @router.post("/completions", response_model=Completion, responses=_STREAM_DOC)
    async def completions(body: CompletionRequestIn, http: Request) -> Response:
        """Text completion; ``stream=true`` for SSE."""
        request = body.to_engine()
        shape = _Shape(chat=False, id=f"cmpl-{uuid.uuid4().hex}", model=body.model, created=int(time.time()),
                       echo=request.prompt if body.echo else "")
        return await serve(http, request, shape, body.stream, body.include_usage)

    async def serve(http: Request, request: GenerationRequest, shape: _Shape, stream: bool,
                    include_usage: bool) -> Response:
        client = client_key(request.user, http)
        request = msgspec.structs.replace(request, client=client)  # peers queue it fairly too
        await admission.acquire(client)  # the backend raises UnknownModel (404) or NoCapacity (503) itself
        try:
            events = backend.generate(request)
            first = await _first(events)
        except BaseException:
            admission.release()
            raise
        if stream:
            return StreamingResponse(_stream(first, events, shape, include_usage, admission),
                                     media_type="text/event-stream",
                                     headers={"cache-control": "no-cache", "x-accel-buffering": "no"})
        try:
            text, finish = await _collect_unless_gone(http, first, events)
        finally:
            await aclose(events)
            admission.release()
        if finish is None:  # the client left; nobody reads this
            return Response(status_code=499)
        return JSONResponse(shape.whole(text, finish))

    return router


async def aclose(events: AsyncIterator[GenerationEvent]) -> None:
    """Close a backend's stream (cancelling its generation) if it can be closed."""
    close = getattr(events, "aclose", None)
    if close is not None:
        await close()


async def _first(events: AsyncIterator[GenerationEvent]) -> GenerationEvent:
    try:
        return await anext(events)
    except StopAsyncIteration:
        raise UpstreamError("the serving engine ended the stream without a result") from None


async def _drain(first: GenerationEvent, events: AsyncIterator[GenerationEvent]) -> tuple[str, Finish]:
    parts: list[str] = []
    event = first
    while not isinstance(event, Finish):
        parts.append(event.text)
        event = await _first(events)
    return "".join(parts), event


async def _wait_disconnect(http: Request) -> None:
    while (await http.receive())["type"] != "http.disconnect":
        pass


async def _collect_unless_gone(http: Request, first: GenerationEvent,
                               events: AsyncIterator[GenerationEvent]) -> tuple[str, Finish | None]:
    """The whole text, or ``("", None)`` if the client disconnected first (generation cancelled)."""
    collector = asyncio.ensure_future(_drain(first, events))
    watcher = asyncio.ensure_future(_wait_disconnect(http))
    try:
        await asyncio.wait({collector, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (watcher, collector):
            if not task.done():
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
    if collector.cancelled():
        return "", None
    return collector.result()


async def _stream(first: GenerationEvent, events: AsyncIterator[GenerationEvent], shape: _Shape,
                  include_usage: bool, admission: Admission) -> AsyncIterator[str]:
    """SSE text for one generation; releases its admission slot however it ends."""
    try:
        for chunk in shape.opening():
            yield _sse(chunk)
        event = first
        while isinstance(event, TextDelta):
            yield _sse(shape.text(event.text))
            event = await _first(events)
        for chunk in shape.closing(event, include_usage):
            yield _sse(chunk)
        yield "data: [DONE]\n\n"
    except Exception as exc:  # after the first byte the status is sent: report inside the stream
        yield _sse(error_for(exc)[1])
    finally:
        await aclose(events)
        admission.release()
