"""``POST /v1/completions``: OpenAI text completion, with batched and token-id prompts, ``n``, logprobs and echo.

A request with several prompts and ``n`` choices each runs ``prompts x n`` generations
concurrently; choice ``index`` is ``prompt * n + choice``, OpenAI's order. Streams are
``text_completion`` chunks (``choices[0].text``), interleaved by index, then ``data: [DONE]``.
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
from meshllm.api.schemas import Completion, CompletionRequestIn
from meshllm.api.tools import NO_TOOLS
from meshllm.engine.base import TokenLogprob, Usage
from meshllm.runtime.backend import Backend
from meshllm.runtime.errors import error_for


def completion_logprobs(logprobs: Sequence[TokenLogprob], offset: int = 0) -> dict[str, Any]:
    """The legacy completions ``logprobs`` object; ``offset`` is where the tokens' text starts."""
    tokens = [lp.piece.decode("utf-8", "replace") for lp in logprobs]
    offsets = []
    for token in tokens:
        offsets.append(offset)
        offset += len(token)
    return {"tokens": tokens, "token_logprobs": [lp.logprob for lp in logprobs],
            "top_logprobs": [{t.piece.decode("utf-8", "replace"): t.logprob for t in lp.top} for lp in logprobs],
            "text_offset": offsets}


class CompletionShape:
    """How one text completion renders its chunks and its whole response."""

    def __init__(self, model: str, echoes: list[str], logprobs: bool, prompts: int) -> None:
        self.id = f"cmpl-{uuid.uuid4().hex}"
        self.model = model
        self.created = int(time.time())
        self.echoes = echoes
        """Per choice: the prompt text to prepend (``echo``), else ``""``."""
        self.logprobs = logprobs
        self.prompts = prompts

    def chunk(self, index: int, text: str, finish: str | None = None, logprobs: Any = None) -> dict[str, Any]:
        return {"id": self.id, "object": "text_completion", "created": self.created, "model": self.model,
                "choices": [{"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}]}

    def whole(self, choices: list[Collected]) -> dict[str, Any]:
        out = [{"index": i, "text": self.echoes[i] + c.text, "finish_reason": c.reason,
                "logprobs": completion_logprobs(c.logprobs, len(self.echoes[i])) if self.logprobs else None}
               for i, c in enumerate(choices)]
        usage = usage_total([c.usage for c in choices], self.prompts)
        body = Completion.model_validate({"id": self.id, "created": self.created, "model": self.model,
                                          "choices": out, "usage": openai_usage(usage)})
        return body.model_dump()


async def _chunks(shape: CompletionShape, generations: list[Generation], include_usage: bool) -> AsyncIterator[str]:
    for i, echo in enumerate(shape.echoes):
        if echo:
            yield sse(shape.chunk(i, echo))
    offsets = [len(e) for e in shape.echoes]
    usages: list[Usage | None] = [None] * len(generations)
    async with contextlib.aclosing(merged([reply(g, NO_TOOLS) for g in generations])) as pieces:
        async for i, piece in pieces:
            if isinstance(piece, TextPiece):
                lp = completion_logprobs(piece.logprobs, offsets[i]) if shape.logprobs else None
                offsets[i] += len(piece.text)
                yield sse(shape.chunk(i, piece.text, logprobs=lp))
            elif isinstance(piece, Ended):
                usages[i] = piece.usage
                yield sse(shape.chunk(i, "", finish=piece.reason))
    if include_usage:
        usage = usage_total([u for u in usages if u is not None], shape.prompts)
        yield sse({**shape.chunk(0, ""), "choices": [], "usage": openai_usage(usage)})
    yield "data: [DONE]\n\n"


def router(backend: Backend, admission: Admission) -> APIRouter:
    """The text completion route over ``backend``."""
    routes = APIRouter(prefix="/v1", tags=["openai"], responses=ERROR_RESPONSES)

    @routes.post("/completions", response_model=Completion,
                 responses=stream_doc("one text_completion chunk per data event, then data: [DONE]"))
    async def completions(body: CompletionRequestIn, http: Request) -> Response:
        """Text completion; ``stream=true`` for SSE."""
        requests = body.to_engine()
        echoes = [r.prompt if body.echo and isinstance(r.prompt, str) else "" for r in requests]
        generations = await start_all(backend, admission, requests, http)
        shape = CompletionShape(generations[0].model, echoes, logprobs=body.logprobs is not None,
                                prompts=len(body.prompts()))
        if body.stream:
            return sse_response(generations, _chunks(shape, generations, body.include_usage),
                                lambda exc: sse(error_for(exc)[1]))
        try:
            choices = await unless_disconnected(http, collect_all(generations, NO_TOOLS))
        finally:
            await close_all(generations)
        if choices is None:  # the client left; nobody reads this
            return Response(status_code=499)
        return JSONResponse(shape.whole(choices))

    return routes
