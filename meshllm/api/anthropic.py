"""Anthropic's Messages API, ``POST /v1/messages`` (what Claude Code and the ``anthropic`` SDK speak).

``system`` (a string or text blocks) and ``messages`` (strings or content blocks: ``text``,
``tool_use`` in assistant turns, ``tool_result`` in user turns) become one chat conversation;
``tools`` (``{name, description, input_schema}``) and ``tool_choice`` (``auto``, ``any``,
``tool``, ``none``, ``disable_parallel_tool_use``) map onto the same
:class:`~meshllm.api.tools.ToolSpec` and grammar as OpenAI chat. The reply is a ``message`` with
``text`` and ``tool_use`` blocks and a ``stop_reason`` (``end_turn``, ``max_tokens``,
``stop_sequence`` with the ``stop_sequence`` that matched, ``tool_use``).

``stream: true`` sends Anthropic's events: ``message_start``, ``ping``, then per block
``content_block_start``, ``content_block_delta`` (``text_delta`` or ``input_json_delta``),
``content_block_stop``; then ``message_delta`` (stop reason and usage) and ``message_stop``. A
failure after the first event is an ``error`` event. Errors, validation errors included, have
Anthropic's shape ``{"type": "error", "error": {"type", "message"}}``.

``cache_control`` marks on blocks are accepted: prompt caching here is automatic (the engine
reuses cached prefixes), and ``usage.cache_read_input_tokens`` reports what it reused. What
Claude Code sends on every request is accepted where it asks for nothing these models lack:
``thinking`` ``adaptive`` or ``disabled`` (they never think), ``clear_thinking`` context edits
(there is no thinking to clear), ``output_config.effort`` (they have one effort level);
``output_config.format`` (a JSON schema) is enforced by grammar like OpenAI's ``response_format``.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any, Literal

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from fastapi.routing import APIRoute
from pydantic import BaseModel, Field
from starlette.exceptions import HTTPException

from meshllm.api.errors import error_headers
from meshllm.api.generation import (
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
from meshllm.api.schemas import I64_MAX, RequestBody, clean, params, travels
from meshllm.api.tools import NO_TOOLS, Choice, ParsedCall, ToolSpec, function
from meshllm.engine.base import ChatMessage, ChatRequest, ToolCall, Usage
from meshllm.runtime.backend import Backend
from meshllm.runtime.errors import BadRequest, error_for

MAX_STOP_SEQUENCES = 16
_BODY_HEADERS = ("content-length", "content-type")
"""Headers of the re-wrapped error body that are recomputed for the new one."""
_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 413: "request_too_large", 422: "invalid_request_error",
                429: "rate_limit_error", 503: "overloaded_error", 504: "timeout_error"}


class AnthropicErrorDetail(BaseModel):
    type: str
    message: str


class AnthropicError(BaseModel):
    """Every error of the Messages API."""

    type: Literal["error"] = "error"
    error: AnthropicErrorDetail


def anthropic_error(status: int, message: str) -> dict[str, Any]:
    """Anthropic's error body for an HTTP status."""
    kind = _ERROR_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


class AnthropicRoute(APIRoute):
    """A route whose errors, however raised (validation included), leave in Anthropic's shape.

    The app's own handlers still decide status, message and headers (``Retry-After``,
    ``WWW-Authenticate``: one place for that); this only re-wraps their OpenAI-shaped body.
    """

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def route(request: Request) -> Response:
            try:
                return await handler(request)
            except Exception as exc:
                openai_shaped = await _app_error_response(request, exc)
                message = json.loads(bytes(openai_shaped.body))["error"]["message"]
                headers = {k: v for k, v in openai_shaped.headers.items() if k not in _BODY_HEADERS}
                return JSONResponse(anthropic_error(openai_shaped.status_code, message),
                                    status_code=openai_shaped.status_code, headers=headers)

        return route


async def _app_error_response(request: Request, exc: Exception) -> JSONResponse:
    handlers = request.app.exception_handlers
    for cls in type(exc).__mro__:
        if cls in handlers:
            response = await handlers[cls](request, exc)
            if isinstance(response, JSONResponse):
                return response
    if isinstance(exc, HTTPException):
        return JSONResponse({"error": {"message": str(exc.detail)}}, status_code=exc.status_code)
    status, body = error_for(exc)
    return JSONResponse(body, status_code=status, headers=error_headers(exc, status))


class MessagesRequest(RequestBody):
    """``POST /v1/messages``."""

    model: str = Field(min_length=1, max_length=512)
    max_tokens: int = Field(ge=1, le=I64_MAX)
    messages: list[dict[str, Any]] = Field(min_length=1, max_length=10_000)
    system: str | list[dict[str, Any]] | None = None
    stop_sequences: list[str] | None = Field(default=None, max_length=MAX_STOP_SEQUENCES)
    temperature: float | None = Field(default=None, ge=0.0, le=1.0)
    top_p: float | None = Field(default=None, ge=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=0, le=1_000_000)
    min_p: float | None = Field(default=None, ge=0.0, le=1.0, description="meshllm extension (llama.cpp's min-p)")
    repeat_penalty: float | None = Field(default=None, gt=0.0, le=10.0,
                                         description="meshllm extension (llama.cpp's repetition penalty; 1: off)")
    stream: bool = False
    tools: list[dict[str, Any]] | None = Field(default=None, max_length=128)
    tool_choice: dict[str, Any] | None = None
    metadata: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None
    context_management: dict[str, Any] | None = None
    output_config: dict[str, Any] | None = None
    service_tier: str | None = None
    container: Any = None
    mcp_servers: list[Any] | None = None

    def check(self) -> None:
        """400 for what we cannot honour."""
        if self.thinking and self.thinking.get("type") not in (None, "disabled", "adaptive"):
            raise BadRequest("thinking is not supported: the models served here do not think separately "
                             "(disabled and adaptive are accepted: they never think)", param="thinking")
        edits = (self.context_management or {}).get("edits") or []
        if any(not str(e.get("type", "")).startswith("clear_thinking") for e in edits if isinstance(e, dict)):
            raise BadRequest("context_management: only clear_thinking edits (there is no thinking to clear); "
                             "the conversation is never edited server-side", param="context_management")
        fmt = (self.output_config or {}).get("format")
        if fmt is not None and not (isinstance(fmt, dict) and fmt.get("type") == "json_schema"):
            raise BadRequest("output_config.format: only {type: json_schema, schema}", param="output_config.format")
        if self.container is not None or self.mcp_servers:
            which = "container" if self.container is not None else "mcp_servers"
            raise BadRequest(f"{which} is not supported", param=which)
        if self.service_tier not in (None, "auto", "standard_only"):
            raise BadRequest("service_tier: only auto or standard_only", param="service_tier")
        for name in ("tools", "messages", "system"):
            travels(getattr(self, name), name, name)

    def tool_spec(self) -> ToolSpec:
        functions = []
        for i, tool in enumerate(self.tools or ()):
            if tool.get("type") not in (None, "custom"):
                raise BadRequest(f"tools[{i}].type {tool.get('type')!r} is not supported (only client tools)",
                                 param=f"tools[{i}].type")
            functions.append(function(tool.get("name"), tool.get("description"), tool.get("input_schema"),
                                      f"tools[{i}]"))
        choice: Choice = "auto"
        parallel = True
        if self.tool_choice is not None:
            kind = self.tool_choice.get("type")
            mapped = {"auto": "auto", "any": "required", "none": "none"}.get(kind or "")
            if kind == "tool" and isinstance(self.tool_choice.get("name"), str):
                mapped = self.tool_choice["name"]
            if mapped is None:
                raise BadRequest("tool_choice.type must be auto, any, tool (with name) or none",
                                 param="tool_choice")
            choice = mapped
            parallel = not self.tool_choice.get("disable_parallel_tool_use", False)
        if not functions and choice == "auto":
            return NO_TOOLS
        return ToolSpec(tuple(functions), choice, parallel=parallel)

    def conversation(self) -> list[ChatMessage]:
        out: list[ChatMessage] = []
        if self.system:
            out.append(ChatMessage("system", clean(_text_blocks(self.system, "system"))))
        for i, message in enumerate(self.messages):
            role, content, where = message.get("role"), message.get("content"), f"messages[{i}]"
            if role not in ("user", "assistant"):
                raise BadRequest(f"{where}.role must be user or assistant", param=f"{where}.role")
            blocks = [{"type": "text", "text": content}] if isinstance(content, str) else content
            if not isinstance(blocks, list):
                raise BadRequest(f"{where}.content must be a string or a list of blocks", param=f"{where}.content")
            out += _user_turn(blocks, where) if role == "user" else [_assistant_turn(blocks, where)]
        return out

    def user_key(self) -> str | None:
        """``metadata.user_id``: the session key routing uses for affinity."""
        user = (self.metadata or {}).get("user_id")
        return clean(user) if isinstance(user, str) and user else None


class CountTokensRequest(MessagesRequest):
    """``POST /v1/messages/count_tokens``: a message request without ``max_tokens``."""

    max_tokens: int | None = Field(default=None, ge=1, le=I64_MAX)  # type: ignore[assignment]


def _text_blocks(content: str | list[dict[str, Any]] | Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise BadRequest(f"{where} must be a string or a list of text blocks", param=where)
    texts = []
    for j, block in enumerate(content):
        if not isinstance(block, dict) or block.get("type") != "text" or not isinstance(block.get("text"), str):
            kind = block.get("type") if isinstance(block, dict) else type(block).__name__
            raise BadRequest(f"{where}[{j}]: block of type {kind!r} is not supported here (text only)",
                             param=f"{where}[{j}].type")
        texts.append(block["text"])
    return "\n\n".join(texts)


def _user_turn(blocks: list[Any], where: str) -> list[ChatMessage]:
    """Tool results first (they answer the previous assistant turn), then the user's text."""
    results, texts = [], []
    for j, block in enumerate(blocks):
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text" and isinstance(block.get("text"), str):
            texts.append(block["text"])
        elif kind == "tool_result" and isinstance(block.get("tool_use_id"), str):
            body = block.get("content")
            text = "" if body is None else _text_blocks(body, f"{where}.content[{j}].content")
            if block.get("is_error"):
                text = f"Error: {text}"
            results.append(ChatMessage("tool", clean(text), tool_call_id=clean(block["tool_use_id"])))
        else:
            raise BadRequest(f"{where}.content[{j}]: block of type {kind!r} is not supported in a user turn "
                             "(text and tool_result only)", param=f"{where}.content[{j}].type")
    return results + ([ChatMessage("user", clean("\n\n".join(texts)))] if texts or not results else [])


def _assistant_turn(blocks: list[Any], where: str) -> ChatMessage:
    texts, calls = [], []
    for j, block in enumerate(blocks):
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text" and isinstance(block.get("text"), str):
            texts.append(block["text"])
        elif kind == "tool_use" and isinstance(block.get("id"), str) and isinstance(block.get("name"), str):
            calls.append(ToolCall(id=clean(block["id"]), name=clean(block["name"]),
                                  arguments=json.dumps(block.get("input") or {}, ensure_ascii=False)))
        else:
            raise BadRequest(f"{where}.content[{j}]: block of type {kind!r} is not supported in an assistant turn "
                             "(text and tool_use only)", param=f"{where}.content[{j}].type")
    return ChatMessage("assistant", clean("".join(texts)), tool_calls=tuple(calls))


# ---- rendering ----------------------------------------------------------------------------------

def _stop_reason(reason: str, stop_sequence: str | None) -> str:
    if reason == "tool_calls":
        return "tool_use"
    if reason == "length":
        return "max_tokens"
    return "stop_sequence" if stop_sequence is not None else "end_turn"


def _usage(usage: Usage) -> dict[str, Any]:
    return {"input_tokens": usage.prompt_tokens, "output_tokens": usage.completion_tokens,
            "cache_read_input_tokens": usage.cached_tokens, "cache_creation_input_tokens": 0}


def _tool_use(call: ParsedCall, with_input: bool = True) -> dict[str, Any]:
    return {"type": "tool_use", "id": "toolu_" + call.id.removeprefix("call_"), "name": call.name,
            "input": json.loads(call.arguments) if with_input else {}}


def _message(message_id: str, model: str, content: list[dict[str, Any]], stop_reason: str | None,
             stop_sequence: str | None, usage: Usage) -> dict[str, Any]:
    return {"id": message_id, "type": "message", "role": "assistant", "model": model, "content": content,
            "stop_reason": stop_reason, "stop_sequence": stop_sequence, "usage": _usage(usage)}


def _whole(message_id: str, model: str, got: Collected) -> dict[str, Any]:
    text = got.text.strip() if got.calls else got.text
    content = ([{"type": "text", "text": text}] if text else []) + [_tool_use(c) for c in got.calls]
    return _message(message_id, model, content, _stop_reason(got.reason, got.stop_sequence), got.stop_sequence,
                    got.usage)


async def _events(message_id: str, model: str, generation: Generation, tools: ToolSpec) -> AsyncIterator[str]:
    yield sse({"type": "message_start", "message": _message(message_id, model, [], None, None, Usage(0, 0))},
              "message_start")
    yield sse({"type": "ping"}, "ping")
    index, text_open, made_calls = 0, False, False
    async for piece in reply(generation, tools):
        if isinstance(piece, TextPiece) and piece.text:
            if not text_open:
                if made_calls and not piece.text.strip():
                    continue
                text_open = True
                yield sse({"type": "content_block_start", "index": index,
                           "content_block": {"type": "text", "text": ""}}, "content_block_start")
            yield sse({"type": "content_block_delta", "index": index,
                       "delta": {"type": "text_delta", "text": piece.text}}, "content_block_delta")
        elif isinstance(piece, ToolCallPiece):
            if text_open:
                yield sse({"type": "content_block_stop", "index": index}, "content_block_stop")
                index, text_open = index + 1, False
            made_calls = True
            yield sse({"type": "content_block_start", "index": index,
                       "content_block": _tool_use(piece.call, with_input=False)}, "content_block_start")
            yield sse({"type": "content_block_delta", "index": index,
                       "delta": {"type": "input_json_delta", "partial_json": piece.call.arguments}},
                      "content_block_delta")
            yield sse({"type": "content_block_stop", "index": index}, "content_block_stop")
            index += 1
        elif isinstance(piece, Ended):
            if text_open:
                yield sse({"type": "content_block_stop", "index": index}, "content_block_stop")
            yield sse({"type": "message_delta",
                       "delta": {"stop_reason": _stop_reason(piece.reason, piece.stop_sequence),
                                 "stop_sequence": piece.stop_sequence},
                       "usage": _usage(piece.usage)}, "message_delta")
            yield sse({"type": "message_stop"}, "message_stop")


def router(backend: Backend, admission: Admission) -> APIRouter:
    """The Messages API routes over ``backend``."""
    errors = {status: {"model": AnthropicError, "description": why}
              for status, why in ((400, "A field this server cannot honour"), (404, "Unknown model"),
                                  (413, "Request body too large"), (422, "A field is missing or invalid"),
                                  (502, "The serving node failed"), (503, "No capacity"),
                                  (504, "The serving node did not answer in time"))}
    routes = APIRouter(prefix="/v1", tags=["anthropic"], responses=errors, route_class=AnthropicRoute)

    def engine_request(body: MessagesRequest, tools: ToolSpec, max_tokens: int, grammar: str | None) -> ChatRequest:
        body.check()
        return ChatRequest(
            model=body.model, messages=tuple(body.conversation()), tools=tools.engine_tools(),
            params=params(max_tokens=max_tokens, temperature=body.temperature, top_p=body.top_p, top_k=body.top_k,
                          min_p=body.min_p, repeat_penalty=body.repeat_penalty,
                          stop=tuple(body.stop_sequences or ()), grammar=grammar,
                          end_on_repeated_call=tools.repeats_end),
            user=body.user_key())

    @routes.post("/messages", responses=stream_doc("Anthropic message stream events (event: <type>, data: JSON)"))
    async def messages(body: MessagesRequest, http: Request) -> Response:
        """Create a message; ``stream=true`` for its events."""
        tools = body.tool_spec()
        fmt = (body.output_config or {}).get("format")
        request = engine_request(body, tools, body.max_tokens, build_grammar(tools, fmt, "output_config.format"))
        message_id = f"msg_{uuid.uuid4().hex}"
        generations = await start_all(backend, admission, [request], http)
        if body.stream:
            def error_event(exc: BaseException) -> str:
                status, err = error_for(exc)
                return sse(anthropic_error(status, err["error"]["message"]), "error")

            events = _events(message_id, generations[0].model, generations[0], tools)
            return sse_response(generations, events, error_event)
        try:
            got = await unless_disconnected(http, collect(reply(generations[0], tools)))
        finally:
            await close_all(generations)
        if got is None:
            return Response(status_code=499)
        return JSONResponse(_whole(message_id, generations[0].model, got))

    @routes.post("/messages/count_tokens")
    async def count_tokens(body: CountTokensRequest, http: Request) -> dict[str, int]:
        """Tokens the conversation takes, counted by the serving engine (it evaluates the prompt and one token)."""
        request = engine_request(body, body.tool_spec(), 1, None)
        generations = await start_all(backend, admission, [request], http)
        try:
            got = await collect(reply(generations[0], NO_TOOLS))
        finally:
            await close_all(generations)
        return {"input_tokens": got.usage.prompt_tokens}

    return routes
