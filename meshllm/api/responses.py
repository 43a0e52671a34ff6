"""``/v1/responses``: OpenAI's Responses API over the same generation path as chat.

A request's ``instructions`` and ``input`` (a string, or items: messages, ``function_call`` and
``function_call_output``) become one chat conversation; function tools, ``tool_choice`` and
``text.format`` map onto the same :class:`~meshllm.api.tools.ToolSpec` and grammar as chat. The
reply is a response object whose ``output`` holds a ``message`` item (the text) and one
``function_call`` item per call.

``stream: true`` sends the Responses event sequence, each as ``event: <type>`` plus JSON data with
a ``sequence_number``: ``response.created``, ``response.in_progress``, then per output item
``response.output_item.added``, for text ``response.content_part.added``,
``response.output_text.delta`` ... ``response.output_text.done``, ``response.content_part.done``,
for a call ``response.function_call_arguments.delta`` / ``.done``, then
``response.output_item.done``; finally ``response.completed`` (or ``response.incomplete`` when
``max_output_tokens`` cut it). A failure after the first event is an ``error`` event.

Responses are kept in memory on the node that made them (``store``, default true, as OpenAI),
for ``GET /v1/responses/{id}`` and ``previous_response_id``; a restart or another node does not
know them.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, Literal

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from pydantic import Field

from meshllm.api.generation import (
    ERROR_RESPONSES,
    Collected,
    Ended,
    Generation,
    TextPiece,
    ToolCallPiece,
    close_all,
    collect,
    reply,
    sse,
    sse_response,
    start_all,
    stream_doc,
    unless_disconnected,
)
from meshllm.api.grammar import build_grammar
from meshllm.api.limits import Admission
from meshllm.api.schemas import I64_MAX, I64_MIN, RequestBody, clean, params, travels
from meshllm.api.tools import NO_TOOLS, Choice, ParsedCall, ToolSpec, function
from meshllm.engine.base import ChatMessage, ChatRequest, ToolCall, Usage
from meshllm.runtime.backend import Backend
from meshllm.runtime.errors import ApiError, BadRequest, error_for

log = logging.getLogger(__name__)

STORE_SIZE = 1000
"""Stored responses per node (oldest dropped first)."""
TEXT_PARTS = ("input_text", "output_text", "text")


class ResponsesRequest(RequestBody):
    """``POST /v1/responses``."""

    model: str = Field(min_length=1, max_length=512)
    input: str | list[dict[str, Any]] = Field(description="a string, or a list of input items")
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = Field(default=None, max_length=128)
    tool_choice: Literal["auto", "none", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    max_output_tokens: int | None = Field(default=None, ge=1, le=I64_MAX)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, ge=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=0, le=1_000_000, description="meshllm extension")
    min_p: float | None = Field(default=None, ge=0.0, le=1.0, description="meshllm extension (llama.cpp's min-p)")
    repeat_penalty: float | None = Field(default=None, gt=0.0, le=10.0,
                                         description="meshllm extension (llama.cpp's repetition penalty; 1: off)")
    seed: int | None = Field(default=None, ge=I64_MIN, le=I64_MAX, description="meshllm extension")
    stream: bool = False
    text: dict[str, Any] | None = None
    store: bool | None = None
    previous_response_id: str | None = Field(default=None, max_length=256)
    metadata: dict[str, str] | None = None
    user: str | None = Field(default=None, max_length=512)
    prompt_cache_key: str | None = Field(default=None, max_length=512)
    truncation: Literal["disabled", "auto"] | None = None
    reasoning: dict[str, Any] | None = None
    include: list[str] | None = None
    background: bool | None = None
    max_tool_calls: int | None = None
    top_logprobs: int | None = None
    service_tier: str | None = None
    safety_identifier: str | None = Field(default=None, max_length=512)
    stream_options: dict[str, Any] | None = Field(default=None, description="accepted: events are never obfuscated")
    conversation: str | dict[str, Any] | None = None
    prompt: dict[str, Any] | None = None
    client_metadata: dict[str, Any] | None = Field(
        default=None, description="what the client says about itself (Codex sends it): logged with the request")

    def check(self) -> None:
        """400 for what we cannot honour."""
        if self.truncation == "auto":
            raise BadRequest("truncation 'auto' is not supported: a conversation over the context is a 400",
                             param="truncation")
        effort = (self.reasoning or {}).get("effort")
        if effort not in (None, "none"):  # a summary of no reasoning is honoured trivially
            raise BadRequest("reasoning.effort is not supported: the models served here do not reason separately",
                             param="reasoning.effort")
        other = [i for i in self.include or () if i != "reasoning.encrypted_content"]
        if other:
            raise BadRequest(f"include {other[0]!r} is not supported", param="include")
        for name, why in (("background", "responses run in the foreground"),
                          ("max_tool_calls", "the number of calls is not limited"),
                          ("top_logprobs", "use /v1/chat/completions for logprobs"),
                          ("conversation", "conversations are not stored; pass previous_response_id or the input"),
                          ("prompt", "stored prompt templates are not kept here; send the input")):
            if getattr(self, name):
                raise BadRequest(f"{name} is not supported: {why}", param=name)
        if self.service_tier not in (None, "auto", "default"):
            raise BadRequest("service_tier: only auto or default", param="service_tier")
        for name in ("tools", "text", "input"):
            travels(getattr(self, name), name, name)

    def tool_spec(self) -> ToolSpec:
        functions = []
        for i, tool in enumerate(self.tools or ()):
            if tool.get("type") != "function":
                raise BadRequest(f"tools[{i}].type {tool.get('type')!r} is not supported (only function tools)",
                                 param=f"tools[{i}].type")
            functions.append(function(tool.get("name"), tool.get("description"), tool.get("parameters"),
                                      f"tools[{i}]", tool.get("strict")))
        choice: Choice = "auto"
        if isinstance(self.tool_choice, str):
            choice = self.tool_choice
        elif isinstance(self.tool_choice, dict):
            if self.tool_choice.get("type") != "function" or not isinstance(self.tool_choice.get("name"), str):
                raise BadRequest("tool_choice: only auto, none, required or {type: function, name}",
                                 param="tool_choice")
            choice = self.tool_choice["name"]
        if not functions and choice == "auto":
            return NO_TOOLS
        return ToolSpec(tuple(functions), choice, parallel=self.parallel_tool_calls is not False)

    def text_format(self) -> dict[str, Any] | None:
        fmt = (self.text or {}).get("format")
        if fmt is not None and not isinstance(fmt, dict):
            raise BadRequest("text.format must be an object", param="text.format")
        return fmt


def input_messages(items: str | list[dict[str, Any]]) -> list[ChatMessage]:
    """The conversation an ``input`` describes."""
    if isinstance(items, str):
        return [ChatMessage("user", clean(items))]
    out: list[ChatMessage] = []
    names: dict[str, str] = {}
    for i, item in enumerate(items):
        kind = item.get("type", "message")
        where = f"input[{i}]"
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise BadRequest(f"{where}.role must be user, system, developer or assistant", param=f"{where}.role")
            out.append(ChatMessage(role, clean(_content(item.get("content"), f"{where}.content"))))
        elif kind == "function_call":
            call_id, name, args = item.get("call_id"), item.get("name"), item.get("arguments", "{}")
            if not all(isinstance(v, str) for v in (call_id, name, args)):
                raise BadRequest(f"{where}: a function_call needs string call_id, name and arguments", param=where)
            names[call_id] = name
            call = ToolCall(id=clean(call_id), name=clean(name), arguments=clean(args))
            if out and out[-1].role == "assistant" and (out[-1].tool_calls or not out[-1].content):
                last = out.pop()
                out.append(ChatMessage("assistant", last.content, tool_calls=(*last.tool_calls, call)))
            else:
                out.append(ChatMessage("assistant", "", tool_calls=(call,)))
        elif kind == "function_call_output":
            call_id = item.get("call_id")
            if not isinstance(call_id, str):
                raise BadRequest(f"{where}: a function_call_output needs the call_id it answers",
                                 param=f"{where}.call_id")
            output = _content(item.get("output"), f"{where}.output")
            out.append(ChatMessage("tool", clean(output), name=names.get(call_id), tool_call_id=clean(call_id)))
        else:
            raise BadRequest(f"{where}.type {kind!r} is not supported (messages, function_call and "
                             "function_call_output items only)", param=f"{where}.type")
    return out


def _content(content: Any, where: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise BadRequest(f"{where} must be a string or a list of text parts", param=where)
    texts = []
    for j, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") not in TEXT_PARTS or not isinstance(part.get("text"), str):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise BadRequest(f"{where}[{j}]: content of type {kind!r} is not supported (text models only)",
                             param=f"{where}[{j}].type")
        texts.append(part["text"])
    return "".join(texts)


# ---- rendering ----------------------------------------------------------------------------------

@dataclass
class Stored:
    """A stored response and the conversation it continues (input + output)."""

    body: dict[str, Any]
    conversation: tuple[ChatMessage, ...]


def _usage(usage: Usage) -> dict[str, Any]:
    return {"input_tokens": usage.prompt_tokens, "input_tokens_details": {"cached_tokens": usage.cached_tokens},
            "output_tokens": usage.completion_tokens, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": usage.total_tokens}


class ResponseShape:
    """One response object as it is built, streamed or not."""

    def __init__(self, body: ResponsesRequest, tools: ToolSpec, model: str) -> None:
        self.model = model
        """The model it runs on (what ``auto`` stood for, when the request named ``auto``)."""
        self.id = f"resp_{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.request = body
        self.tools = tools
        self.output: list[dict[str, Any]] = []

    def message_item(self, text: str, status: str = "completed") -> dict[str, Any]:
        content = [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}] if status != \
            "in_progress" else []
        return {"type": "message", "id": f"msg_{uuid.uuid4().hex}", "status": status, "role": "assistant",
                "content": content}

    @staticmethod
    def call_item(call: ParsedCall, status: str = "completed") -> dict[str, Any]:
        return {"type": "function_call", "id": f"fc_{call.id.removeprefix('call_')}", "call_id": call.id,
                "name": call.name, "arguments": call.arguments if status == "completed" else "", "status": status}

    def body(self, status: str, usage: Usage | None = None, incomplete: bool = False) -> dict[str, Any]:
        req = self.request
        tool_choice: Any = self.tools.choice if self.tools.choice in ("auto", "none", "required") else \
            {"type": "function", "name": self.tools.choice}
        return {
            "id": self.id, "object": "response", "created_at": self.created, "status": status,
            "model": self.model, "output": list(self.output), "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
            "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
            "parallel_tool_calls": self.tools.parallel, "previous_response_id": req.previous_response_id,
            "store": req.store is not False, "temperature": 1.0 if req.temperature is None else req.temperature,
            "top_p": 1.0 if req.top_p is None else req.top_p, "tool_choice": tool_choice,
            "tools": req.tools or [], "text": req.text or {"format": {"type": "text"}}, "truncation": "disabled",
            "usage": _usage(usage) if usage is not None else None, "metadata": req.metadata or {},
            "user": req.user, "reasoning": None,
        }

    def whole(self, reply_: Collected) -> dict[str, Any]:
        text = reply_.text.strip() if reply_.calls else reply_.text
        if text or not reply_.calls:
            self.output.append(self.message_item(text))
        self.output += [self.call_item(c) for c in reply_.calls]
        incomplete = reply_.reason == "length"
        return self.body("incomplete" if incomplete else "completed", reply_.usage, incomplete)


class _Events:
    """Numbers the events of one streamed response."""

    def __init__(self) -> None:
        self.seq = 0

    def __call__(self, kind: str, **fields: Any) -> str:
        event = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return sse(event, kind)


async def _stream(shape: ResponseShape, generation: Generation, tools: ToolSpec, events: _Events,
                  done: list[tuple[Collected, dict[str, Any]]]) -> AsyncIterator[str]:
    """The event sequence of one response; ``done`` receives the reply and the final body."""
    yield events("response.created", response=shape.body("in_progress"))
    yield events("response.in_progress", response=shape.body("in_progress"))
    text_item: dict[str, Any] | None = None
    parts: list[str] = []
    collected = Collected()

    def close_text() -> list[str]:
        nonlocal text_item
        if text_item is None:
            return []
        index, text = len(shape.output), "".join(parts)
        item = {**text_item, "status": "completed",
                "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]}
        shape.output.append(item)
        text_item = None
        ids = {"item_id": item["id"], "output_index": index}
        return [events("response.output_text.done", **ids, content_index=0, text=text, logprobs=[]),
                events("response.content_part.done", **ids, content_index=0, part=item["content"][0]),
                events("response.output_item.done", output_index=index, item=item)]

    async for piece in reply(generation, tools):
        if isinstance(piece, TextPiece) and piece.text:
            if text_item is None:
                if not piece.text.strip() and collected.calls:
                    continue
                text_item = shape.message_item("", "in_progress")
                ids = {"item_id": text_item["id"], "output_index": len(shape.output)}
                yield events("response.output_item.added", output_index=len(shape.output), item=text_item)
                yield events("response.content_part.added", **ids, content_index=0,
                             part={"type": "output_text", "text": "", "annotations": []})
            parts.append(piece.text)
            yield events("response.output_text.delta", item_id=text_item["id"], output_index=len(shape.output),
                         content_index=0, delta=piece.text, logprobs=[])
        elif isinstance(piece, ToolCallPiece):
            for event in close_text():
                yield event
            collected.calls.append(piece.call)
            index, item = len(shape.output), shape.call_item(piece.call, "in_progress")
            yield events("response.output_item.added", output_index=index, item=item)
            yield events("response.function_call_arguments.delta", item_id=item["id"], output_index=index,
                         delta=piece.call.arguments)
            yield events("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                         arguments=piece.call.arguments, name=piece.call.name)
            item = shape.call_item(piece.call)
            shape.output.append(item)
            yield events("response.output_item.done", output_index=index, item=item)
        elif isinstance(piece, Ended):
            for event in close_text():
                yield event
            collected.text, collected.reason, collected.usage = "".join(parts), piece.reason, piece.usage
            incomplete = piece.reason == "length"
            final = shape.body("incomplete" if incomplete else "completed", piece.usage, incomplete)
            done.append((collected, final))
            yield events("response.incomplete" if incomplete else "response.completed", response=final)


def router(backend: Backend, admission: Admission) -> APIRouter:
    """The Responses API routes over ``backend``, with this node's response store."""
    routes = APIRouter(prefix="/v1", tags=["openai"], responses=ERROR_RESPONSES)
    store: OrderedDict[str, Stored] = OrderedDict()

    def keep(shape: ResponseShape, conversation: list[ChatMessage], reply_: Collected, body: dict[str, Any]) -> None:
        if shape.request.store is False:
            return
        answer = ChatMessage("assistant", clean(reply_.text.strip() if reply_.calls else reply_.text),
                             tool_calls=tuple(ToolCall(c.id, c.name, c.arguments) for c in reply_.calls))
        store[shape.id] = Stored(body, (*conversation, answer))
        while len(store) > STORE_SIZE:
            store.popitem(last=False)

    @routes.post("/responses", responses=stream_doc("Responses API events (event: <type>, data: JSON)"))
    async def create_response(body: ResponsesRequest, http: Request) -> Response:
        """Create a model response; ``stream=true`` for its events."""
        body.check()
        if body.client_metadata:
            log.info("responses request for %s from a client that says %s", body.model, body.client_metadata)
        tools = body.tool_spec()
        conversation: list[ChatMessage] = []
        if body.previous_response_id is not None:
            previous = store.get(body.previous_response_id)
            if previous is None:
                raise BadRequest(f"previous response {body.previous_response_id!r} is not stored on this node "
                                 "(responses are kept in memory on the node that made them)",
                                 param="previous_response_id")
            conversation += [m for m in previous.conversation if m.role not in ("system", "developer")]
        if body.instructions:
            conversation.insert(0, ChatMessage("developer", clean(body.instructions)))
        conversation += input_messages(body.input)
        if not conversation:
            raise BadRequest("input is empty", param="input")
        key = body.user or body.safety_identifier or body.prompt_cache_key
        request = ChatRequest(
            model=body.model, messages=tuple(conversation), tools=tools.engine_tools(),
            params=params(max_tokens=body.max_output_tokens, temperature=body.temperature, top_p=body.top_p,
                          top_k=body.top_k, min_p=body.min_p, repeat_penalty=body.repeat_penalty, seed=body.seed,
                          grammar=build_grammar(tools, body.text_format(), "text.format"),
                          end_on_repeated_call=tools.repeats_end),
            user=clean(key) if key else None)
        generations = await start_all(backend, admission, [request], http)
        shape = ResponseShape(body, tools, generations[0].model)
        if body.stream:
            events, done = _Events(), []

            async def stream() -> AsyncIterator[str]:
                async for chunk in _stream(shape, generations[0], tools, events, done):
                    yield chunk
                if done:
                    keep(shape, conversation, *done[0])

            def error_event(exc: BaseException) -> str:
                error = error_for(exc)[1]["error"]
                return events("error", code=error["code"], message=error["message"], param=error["param"])

            return sse_response(generations, stream(), error_event)
        try:
            collected = await unless_disconnected(http, collect(reply(generations[0], tools)))
        finally:
            await close_all(generations)
        if collected is None:
            return Response(status_code=499)
        out = shape.whole(collected)
        keep(shape, conversation, collected, out)
        return JSONResponse(out)

    @routes.get("/responses/{response_id}")
    async def get_response(response_id: str) -> dict[str, Any]:
        """A stored response (this node's memory), or 404."""
        stored = store.get(response_id)
        if stored is None:
            raise UnknownResponse(f"response {response_id!r} is not stored on this node")
        return stored.body

    @routes.delete("/responses/{response_id}")
    async def delete_response(response_id: str) -> dict[str, Any]:
        """Forget a stored response."""
        if store.pop(response_id, None) is None:
            raise UnknownResponse(f"response {response_id!r} is not stored on this node")
        return {"id": response_id, "object": "response", "deleted": True}

    return routes


class UnknownResponse(ApiError):
    """No stored response has this id (404)."""

    status, type, code = 404, "invalid_request_error", "response_not_found"
    hint = "responses are kept in memory on the node that made them"
