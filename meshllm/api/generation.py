"""The request path every API surface shares: admission, the backend's stream, replies, SSE and disconnects.

Every generation waits for its *first* event before answering. That is what lets an error
discovered late (unknown model on the serving peer, a full queue, a prompt over the context, a
field the serving engine cannot honour) still become a proper status code, and it is the point
until which the backend may fail over to another node. Once the first byte is sent, a failure can
only be reported inside the stream, in the surface's own error event.

A surface (OpenAI chat or completions, Responses, Anthropic Messages) turns its body into engine
requests, :func:`start_all` starts them (one per choice), :func:`reply` turns each engine stream
into :data:`ReplyEvent` s (text with its logprobs, parsed tool calls, the end), and the surface
renders those in its own shapes. When the client goes away, the streaming response's task is
cancelled and :class:`Generation.close` stops the generation wherever it runs; non-streamed
requests watch for the disconnect too (:func:`unless_disconnected`), so nobody generates for a
client that has left.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar

import msgspec
from fastapi import Request
from fastapi.responses import StreamingResponse

from meshllm.api.auto import AUTO, Choice, choose, needs_of
from meshllm.api.limits import Admission, client_key
from meshllm.api.schemas import ErrorResponse
from meshllm.api.tools import CallOut, ParsedCall, TextOut, ToolSpec
from meshllm.engine.base import Finish, GenerationEvent, GenerationRequest, TextDelta, TokenLogprob, Usage
from meshllm.runtime.backend import Backend
from meshllm.runtime.errors import ApiError, UnknownModel, UpstreamError
from meshllm.tasks import Scope, task_group

T = TypeVar("T")

_ERROR = {"model": ErrorResponse}
ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    400: {**_ERROR, "description": "Bad request: invalid JSON, or a field this server cannot honour (param names it)"},
    404: {**_ERROR, "description": "Unknown model"},
    413: {**_ERROR, "description": "Request body too large"},
    422: {**_ERROR, "description": "A field is missing or has the wrong type or range"},
    429: {**_ERROR, "description": "Saturated: no place for this request now; retry after the Retry-After seconds"},
    502: {**_ERROR, "description": "The serving node failed"},
    503: {**_ERROR, "description": "No capacity: all slots or queues are full"},
    504: {**_ERROR, "description": "The serving node did not answer in time"},
}


def stream_doc(what: str) -> dict[int | str, dict[str, Any]]:
    """The OpenAPI entry of a route that streams server-sent events with ``stream=true``."""
    return {200: {"content": {"text/event-stream": {
        "description": f"with stream=true: {what}",
        "schema": {"type": "object", "required": ["data"], "properties": {"data": {"type": "string"}}}}}}}


def sse(obj: dict[str, Any], event: str | None = None) -> str:
    """One server-sent event (``event:`` line when the API names its events)."""
    head = f"event: {event}\n" if event else ""
    return f"{head}data: {json.dumps(obj, ensure_ascii=False)}\n\n"


# ---- starting and stopping generations ----------------------------------------------------------

class Generation:
    """One generation in flight: its admission slot and the backend's stream, first event already read."""

    def __init__(self, admission: Admission, events: AsyncIterator[GenerationEvent], first: GenerationEvent,
                 model: str) -> None:
        self.model = model
        """The model it runs on: the one the request named, or the one ``auto`` stood for."""
        self._admission = admission
        self._events = events
        self._first: GenerationEvent | None = first
        self._closed = False

    async def events(self) -> AsyncIterator[GenerationEvent]:
        """The events, first included, up to and including the :class:`Finish`."""
        event = self._first
        self._first = None
        while event is not None:
            yield event
            if isinstance(event, Finish):
                return
            event = await next_event(self._events)

    async def close(self) -> None:
        """Stop the generation (if it still runs) and give the admission slot back; safe to call twice."""
        if self._closed:
            return
        self._closed = True
        try:
            await aclose(self._events)
        finally:
            self._admission.release()


async def start(backend: Backend, admission: Admission, request: GenerationRequest) -> Generation:
    """Take an admission slot, open the backend's stream and wait for its first event (errors raise here).

    The slot is taken fairly for ``request.client`` (429 when saturated); the backend raises
    UnknownModel (404), NoCapacity (503), ... itself.
    """
    await admission.acquire(request.client)
    events: AsyncIterator[GenerationEvent] | None = None
    try:
        events = backend.generate(request)
        return Generation(admission, events, await next_event(events), request.model)
    except BaseException:
        if events is not None:
            await aclose(events)
        admission.release()
        raise


class ClientGone(ApiError):
    """The HTTP client disconnected before the answer began: nothing is sent (499, nginx's code for it)."""

    status, type, code = 499, "invalid_request_error", "client_disconnected"


async def start_all(backend: Backend, admission: Admission, requests: Sequence[GenerationRequest],
                    http: Request) -> list[Generation]:
    """Start every request (the choices of one API request) concurrently; if one fails, stop the others.

    A client that disconnects while they start (a queued request can wait long for its first
    event) cancels them all and raises :class:`ClientGone`. Each request is tagged with its client
    (``user``, else the HTTP connection) so that this node and the peers it is routed to queue it fairly.
    """
    requests = routed(backend, [msgspec.structs.replace(r, client=client_key(r.user, http)) for r in requests], http)
    started = await unless_disconnected(http, _start_all(backend, admission, requests))
    if started is None:
        raise ClientGone("the client disconnected before the first token")
    return started


ROUTED_HEADER = "x-meshllm-routed-model"
"""Response header naming the model a request for ``auto`` ran on (:class:`RoutedModelHeader` sets it)."""


def routed(backend: Backend, requests: list[GenerationRequest], http: Request) -> list[GenerationRequest]:
    """``requests`` with the ``auto`` model replaced by the model :func:`route_auto` picks, which is kept
    in the request's state for the response header and published with its reason (``app.state.on_event``)."""
    requests, choice = route_auto(backend, requests, getattr(http.app.state, "on_event", None))
    if choice is not None:
        http.state.routed_model = choice.model
    return requests


def route_auto(backend: Backend, requests: list[GenerationRequest],
               on_event: Callable[..., None] | None) -> tuple[list[GenerationRequest], Choice | None]:
    """The choices of one request for ``auto`` sent to the model :func:`meshllm.api.auto.choose` picks
    (an ``auto_routed`` event says which and why); other requests as they are."""
    if not requests or requests[0].model != AUTO:
        return requests, None
    choice = choose(needs_of(requests[0]), backend.models())
    if choice is None:
        raise UnknownModel("model 'auto' picks among the mesh's models, and it serves none yet",
                           hint="start a node with `meshllm serve --model REF`")
    if on_event is not None:
        on_event("auto_routed", model=choice.model, reason=choice.reason)
    return [msgspec.structs.replace(r, model=choice.model) for r in requests], choice


async def _start_all(backend: Backend, admission: Admission, requests: Sequence[GenerationRequest]) -> list[Generation]:
    tasks: list[asyncio.Task[Generation]] = []
    try:
        async with task_group() as group:
            tasks += [group.create_task(start(backend, admission, r)) for r in requests]
    except BaseException:  # one failed or the caller left: the others were cancelled; those that started stop
        for task in tasks:
            if task.done() and not task.cancelled() and task.exception() is None:
                await task.result().close()
        raise
    return [task.result() for task in tasks]


async def aclose(events: AsyncIterator[Any]) -> None:
    """Close a backend's stream (cancelling its generation) if it can be closed."""
    close = getattr(events, "aclose", None)
    if close is not None:
        await close()


async def next_event(events: AsyncIterator[GenerationEvent]) -> GenerationEvent:
    """The next event; a stream that ends without a :class:`Finish` is the serving side's failure."""
    try:
        return await anext(events)
    except StopAsyncIteration:
        raise UpstreamError("the serving engine ended the stream without a result") from None


# ---- replies: what surfaces render --------------------------------------------------------------

@dataclass(frozen=True)
class TextPiece:
    """Reply text, with the logprobs of the tokens that produced it (and any held back before it)."""

    text: str
    logprobs: tuple[TokenLogprob, ...] = ()


@dataclass(frozen=True)
class ToolCallPiece:
    """A complete tool call of the reply."""

    index: int
    call: ParsedCall


ReplyReason = Literal["stop", "length", "tool_calls"]


@dataclass(frozen=True)
class Ended:
    """The reply ended; ``tool_calls`` when it made calls and was not cut by the length limit."""

    reason: ReplyReason
    usage: Usage
    stop_sequence: str | None = None


ReplyEvent = TextPiece | ToolCallPiece | Ended


async def reply(generation: Generation, tools: ToolSpec) -> AsyncIterator[ReplyEvent]:
    """A generation's events as reply pieces, tool calls parsed out when the request offered tools."""
    parser = tools.parser()
    held: list[TokenLogprob] = []
    async for event in generation.events():
        if isinstance(event, TextDelta):
            held += event.logprobs
            outs = parser.feed(event.text) if parser is not None else [TextOut(event.text)]
        else:
            outs = parser.finish(truncated=event.reason == "length") if parser is not None else []
        for out in outs:
            if isinstance(out, CallOut):
                yield ToolCallPiece(out.index, out.call)
            elif out.text:
                yield TextPiece(out.text, tuple(held))
                held = []
        if isinstance(event, Finish):
            if held:
                yield TextPiece("", tuple(held))
            made_calls = parser is not None and bool(parser.calls)
            yield Ended("tool_calls" if made_calls and event.reason == "stop" else event.reason, event.usage,
                        event.stop_sequence)


@dataclass
class Collected:
    """A whole reply."""

    text: str = ""
    calls: list[ParsedCall] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    reason: ReplyReason = "stop"
    usage: Usage = field(default_factory=lambda: Usage(0, 0))
    stop_sequence: str | None = None


async def collect(pieces: AsyncIterator[ReplyEvent]) -> Collected:
    """Everything a reply said, for a non-streamed response."""
    out, parts = Collected(), []
    async for piece in pieces:
        if isinstance(piece, TextPiece):
            parts.append(piece.text)
            out.logprobs += piece.logprobs
        elif isinstance(piece, ToolCallPiece):
            out.calls.append(piece.call)
        else:
            out.reason, out.usage, out.stop_sequence = piece.reason, piece.usage, piece.stop_sequence
    out.text = "".join(parts)
    return out


async def collect_all(generations: Sequence[Generation], tools: ToolSpec) -> list[Collected]:
    """Every choice's whole reply, generated concurrently (one failing stops the others)."""
    async with task_group() as group:
        tasks = [group.create_task(collect(reply(g, tools))) for g in generations]
    return [task.result() for task in tasks]


async def merged(streams: Sequence[AsyncIterator[T]]) -> AsyncIterator[tuple[int, T]]:
    """Items of several streams as they come, tagged with the stream's index (the choices of ``n > 1``)."""
    if len(streams) == 1:
        async for item in streams[0]:
            yield 0, item
        return
    queue: asyncio.Queue[tuple[int, T] | tuple[int, BaseException] | None] = asyncio.Queue()

    async def pump(i: int, stream: AsyncIterator[T]) -> None:
        try:
            async for item in stream:
                await queue.put((i, item))
        except Exception as exc:
            await queue.put((i, exc))
        finally:
            await queue.put(None)

    pumps = Scope("merged choices")  # (a scope, not a task group in this generator: a group must not span a yield)
    for i, s in enumerate(streams):
        pumps.spawn(pump(i, s))
    try:
        running = len(streams)
        while running:
            got = await queue.get()
            if got is None:
                running -= 1
                continue
            i, item = got
            if isinstance(item, BaseException):
                raise item
            yield i, item  # type: ignore[misc]
    finally:
        await pumps.aclose()


def usage_total(usages: Sequence[Usage], prompts: int = 1) -> Usage:
    """One request's usage over its choices: each distinct prompt counted once, every completion counted."""
    per_prompt = max(1, len(usages) // max(1, prompts))
    firsts = usages[::per_prompt]
    return Usage(prompt_tokens=sum(u.prompt_tokens for u in firsts),
                 completion_tokens=sum(u.completion_tokens for u in usages),
                 cached_tokens=sum(u.cached_tokens for u in firsts))


def openai_usage(usage: Usage) -> dict[str, Any]:
    """OpenAI's ``usage`` object (chat and completions)."""
    return {"prompt_tokens": usage.prompt_tokens, "completion_tokens": usage.completion_tokens,
            "total_tokens": usage.total_tokens, "prompt_tokens_details": {"cached_tokens": usage.cached_tokens}}


# ---- HTTP plumbing --------------------------------------------------------------------------

async def _wait_disconnect(http: Request) -> None:
    while (await http.receive())["type"] != "http.disconnect":
        pass


async def unless_disconnected(http: Request, work: Coroutine[Any, Any, T]) -> T | None:
    """``work``'s result, or ``None`` if the client disconnected first (``work`` is then cancelled)."""
    async with task_group() as group:
        task = group.create_task(work)
        watcher = group.create_task(_wait_disconnect(http))
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        task.cancel()  # (nothing if it is done: else the client left first)
        watcher.cancel()
    if task.cancelled():
        return None
    return task.result()


async def close_all(generations: Sequence[Generation]) -> None:
    """Stop every generation and give its slot back."""
    for gen in generations:
        await gen.close()


def sse_response(generations: Sequence[Generation], body: AsyncIterator[str],
                 error_event: Callable[[BaseException], str]) -> StreamingResponse:
    """Stream ``body``; a failure after the first byte becomes ``error_event``; the generations end with it."""

    async def events() -> AsyncIterator[str]:
        try:
            async for chunk in body:
                yield chunk
        except Exception as exc:  # after the first byte the status is sent: report inside the stream
            yield error_event(exc)
        finally:
            await aclose(body)  # stops any task still reading the generations, then they are closed
            await close_all(generations)

    return StreamingResponse(events(), media_type="text/event-stream",
                             headers={"cache-control": "no-cache", "x-accel-buffering": "no"})
