"""``POST /v1/chat/completions``: OpenAI chat, with tools, structured output, logprobs and ``n`` choices.

Streams follow OpenAI's SSE format: ``data: <chunk json>`` events, then ``data: [DONE]``. Each
choice opens with ``delta: {"role": "assistant", "content": ""}``; a tool call arrives as OpenAI
streams it: one delta naming the call (``index``, ``id``, ``type``, ``function.name``, empty
``arguments``), then its ``arguments``; the choice closes with ``delta: {}`` and its
``finish_reason``. With ``n > 1`` the choices' chunks interleave, each tagged with its ``index``.
"""

from __future__ import annotations

import contextlib
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from meshllm.api.generation import (
    ERROR_RESPONSES,
    Collected,
    Ended,
    Generation,
    TextPiece,
    close_all,
    collect_all,
    merged,
    openai_usage,
    reply,
    sse,
    sse_response,
    start_all,
    stream_doc,
    unless_disconnected,
    usage_total,
)
from meshllm.api.limits import Admission
from meshllm.api.schemas import ChatCompletion, ChatCompletionRequest
from meshllm.api.tools import ToolSpec
from meshllm.engine.base import TokenLogprob, Usage
from meshllm.runtime.backend import Backend
from meshllm.runtime.errors import error_for


def chat_logprobs(logprobs: Sequence[TokenLogprob]) -> dict[str, Any]:
    """OpenAI's chat ``logprobs`` object for these tokens."""
    def entry(token: bytes, logprob: float) -> dict[str, Any]:
        return {"token": token.decode("utf-8", "replace"), "logprob": logprob, "bytes": list(token)}

    return {"content": [{**entry(lp.piece, lp.logprob), "top_logprobs": [entry(t.piece, t.logprob) for t in lp.top]}
                        for lp in logprobs], "refusal": None}


def _tool_call(call: Any) -> dict[str, Any]:
    return {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}


class ChatShape:
    """How one chat completion renders its chunks and its whole response."""

    def __init__(self, model: str, logprobs: bool) -> None:
        self.id = f"chatcmpl-{uuid.uuid4().hex}"
        self.model = model
        self.created = int(time.time())
        self.logprobs = logprobs

    def chunk(self, choices: list[dict[str, Any]], usage: Any = None) -> dict[str, Any]:
        out: dict[str, Any] = {"id": self.id, "object": "chat.completion.chunk", "created": self.created,
                               "model": self.model, "system_fingerprint": None, "choices": choices}
        if usage is not None:
            out["usage"] = openai_usage(usage)
        return out

    def delta(self, index: int, delta: dict[str, Any], finish: str | None = None,
              logprobs: Sequence[TokenLogprob] = ()) -> dict[str, Any]:
        lp = chat_logprobs(logprobs) if self.logprobs and logprobs else None
        return self.chunk([{"index": index, "delta": delta, "logprobs": lp, "finish_reason": finish}])

    def whole(self, choices: list[Collected]) -> dict[str, Any]:
        out = []
        for i, c in enumerate(choices):
            text = c.text.strip() if c.calls else c.text  # blank text around calls is formatting
            message = {"role": "assistant", "content": text or (None if c.calls else ""),
                       "tool_calls": [_tool_call(call) for call in c.calls] or None}
            out.append({"index": i, "message": message, "finish_reason": c.reason,
                        "logprobs": chat_logprobs(c.logprobs) if self.logprobs else None})
        body = ChatCompletion.model_validate({"id": self.id, "created": self.created, "model": self.model,
                                              "choices": out,
                                              "usage": openai_usage(usage_total([c.usage for c in choices]))})
        return body.model_dump()


async def _chunks(shape: ChatShape, generations: list[Generation], tools: ToolSpec,
                  include_usage: bool) -> AsyncIterator[str]:
    for i in range(len(generations)):
        yield sse(shape.delta(i, {"role": "assistant", "content": ""}))
    usages: list[Usage | None] = [None] * len(generations)
    async with contextlib.aclosing(merged([reply(g, tools) for g in generations])) as pieces:
        async for i, piece in pieces:
            if isinstance(piece, TextPiece):
                yield sse(shape.delta(i, {"content": piece.text}, logprobs=piece.logprobs))
            elif isinstance(piece, Ended):
                usages[i] = piece.usage
                yield sse(shape.delta(i, {}, finish=piece.reason))
            else:
                head = {"index": piece.index, "id": piece.call.id, "type": "function",
                        "function": {"name": piece.call.name, "arguments": ""}}
                yield sse(shape.delta(i, {"tool_calls": [head]}))
                yield sse(shape.delta(i, {"tool_calls": [{"index": piece.index,
                                                          "function": {"arguments": piece.call.arguments}}]}))
    if include_usage:
        yield sse(shape.chunk([], usage_total([u for u in usages if u is not None])))
    yield "data: [DONE]\n\n"


def router(backend: Backend, admission: Admission) -> APIRouter:
    """The chat completion route over ``backend``."""
    routes = APIRouter(prefix="/v1", tags=["openai"], responses=ERROR_RESPONSES)

    @routes.post("/chat/completions", response_model=ChatCompletion,
                 responses=stream_doc("one chat.completion.chunk per data event, then data: [DONE]"))
    async def chat_completions(body: ChatCompletionRequest, http: Request) -> Response:
        """Chat completion; ``stream=true`` for SSE."""
        tools = body.tool_spec()
        requests = body.to_engine(tools)
        generations = await start_all(backend, admission, requests, http)
        shape = ChatShape(generations[0].model, logprobs=bool(body.logprobs))
        if body.stream:
            return sse_response(generations, _chunks(shape, generations, tools, body.include_usage),
                                lambda exc: sse(error_for(exc)[1]))
        try:
            choices = await unless_disconnected(http, collect_all(generations, tools))
        finally:
            await close_all(generations)
        if choices is None:  # the client left; nobody reads this
            return Response(status_code=499)
        return JSONResponse(shape.whole(choices))

    return routes
