"""The request tunnel: typed frames that carry one request to a peer and its response back.

One bidirectional QUIC stream of kind ``"request"`` per request. The caller sends a
:class:`RequestFrame` (and, if its client goes away, a :class:`CancelFrame`); the server answers
a generation with :class:`DeltaFrame` s and ends with exactly one :class:`FinishFrame` or
:class:`ErrorFrame`; an embedding request is answered by one :class:`EmbeddingsFrame` (or an
error). Fields added since version 1 have defaults, so older peers' frames still decode.

The net layer's streams already frame and decode typed messages (``Stream.send(struct)`` /
``Stream.recv(type)``), so this core works on messages, not bytes: :class:`TunnelClient` and
:class:`TunnelServer` are sans-IO state machines that turn engine events into frames and frames
into engine events or typed errors. They track the stream's state, so a misbehaving peer (a delta
after finish, a second request) is a :class:`~meshllm.errors.DecodeError`, not a corrupt
response. The asyncio driver (``meshllm.api.mesh_backend``) only moves their frames.
"""

from __future__ import annotations

from typing import Literal

import msgspec

from meshllm.api.errors import ApiError, UpstreamError, classify, error_for
from meshllm.engine.base import (
    ChatRequest,
    CompletionRequest,
    Embeddings,
    EmbedRequest,
    Finish,
    FinishReason,
    GenerationEvent,
    GenerationRequest,
    TextDelta,
    TokenLogprob,
    Usage,
)
from meshllm.errors import DecodeError

TUNNEL_VERSION = 1
STREAM_KIND = "request"
"""The stream kind the tunnel is registered under on the QUIC endpoint."""


class RequestFrame(msgspec.Struct, frozen=True, tag="request"):
    """Caller -> server: the request, with how long the caller will wait for it to finish."""

    request_id: str
    request: ChatRequest | CompletionRequest | EmbedRequest
    deadline_ms: int
    """Milliseconds from receipt; the server abandons the request after it."""
    version: int = TUNNEL_VERSION
    model_sha256: str = ""
    """Serve only from a model file with this sha256 (a replay continues on the same file); empty: any."""


class CancelFrame(msgspec.Struct, frozen=True, tag="cancel"):
    """Caller -> server: the client went away; stop generating."""

    reason: str = ""


class DeltaFrame(msgspec.Struct, frozen=True, tag="delta", omit_defaults=True):
    """Server -> caller: generated text, with its token ids and (when asked) their logprobs."""

    text: str
    tokens: tuple[int, ...] = ()
    logprobs: tuple[TokenLogprob, ...] = ()
    model_sha256: str = ""
    """On the first delta: the sha256 of the serving model file (what a replay must run on), if known."""
    final: bool = False
    """The engine's tail delta: only the finish follows (:attr:`~meshllm.engine.base.TextDelta.final`)."""


class FinishFrame(msgspec.Struct, frozen=True, tag="finish"):
    """Server -> caller: generation ended normally."""

    reason: FinishReason
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0
    stop_sequence: str | None = None


class EmbeddingsFrame(msgspec.Struct, frozen=True, tag="embeddings"):
    """Server -> caller: the vectors of an :class:`~meshllm.engine.base.EmbedRequest` (float32 bytes each)."""

    vectors: tuple[bytes, ...]
    prompt_tokens: int


class ErrorFrame(msgspec.Struct, frozen=True, tag="error"):
    """Server -> caller: the request failed; ``status`` is the HTTP status the client should see."""

    status: int
    code: str
    message: str
    param: str | None = None
    """The request field the error is about, when it is about one."""


CallerFrame = RequestFrame | CancelFrame
ServerFrame = DeltaFrame | FinishFrame | EmbeddingsFrame | ErrorFrame
Routable = GenerationRequest | EmbedRequest
"""What travels in a :class:`RequestFrame`."""
TunnelEvent = GenerationEvent | Embeddings
"""What the caller gets back: a generation's events, or the embeddings."""


class RemoteError(ApiError):
    """An error a peer reported in an :class:`ErrorFrame`, keeping its status and code."""

    def __init__(self, frame: ErrorFrame) -> None:
        super().__init__(frame.message)
        self.status = frame.status
        self.code = frame.code
        self.param = frame.param
        self.type = "invalid_request_error" if frame.status < 500 else "server_error"


class ModelMismatch(ApiError):
    """A replay asked for a model file (sha256) this node does not serve under that model id."""

    status, type, code = 503, "server_error", "model_mismatch"


def failover_allowed(exc: BaseException) -> bool:
    """Whether another node might succeed where this one failed (its fault, not the request's)."""
    return classify(exc)[0] >= 500


class TunnelClient:
    """Caller's side of one tunnel stream."""

    def __init__(self) -> None:
        self.state: Literal["idle", "open", "done"] = "idle"
        self.model_sha256 = ""
        """The serving model file's sha256, from the first delta (empty until then, or if the peer did not say)."""

    def start(self, request_id: str, request: Routable, deadline_ms: int, model_sha256: str = "") -> RequestFrame:
        """The frame to send first (``model_sha256``: only that model file may serve it)."""
        if self.state != "idle":
            raise RuntimeError("tunnel already started")
        self.state = "open"
        return RequestFrame(request_id=request_id, request=request, deadline_ms=deadline_ms,
                            model_sha256=model_sha256)

    def cancel(self, reason: str = "client disconnected") -> CancelFrame:
        """The frame that asks the server to stop (send it, then close the stream)."""
        self.state = "done"
        return CancelFrame(reason=reason)

    def receive(self, frame: ServerFrame) -> TunnelEvent:
        """The engine event a frame carries; raises the peer's error as :class:`RemoteError`."""
        if self.state != "open":
            raise DecodeError(f"tunnel peer sent {type(frame).__name__} after the response ended")
        if isinstance(frame, DeltaFrame):
            self.model_sha256 = self.model_sha256 or frame.model_sha256
            return TextDelta(frame.text, frame.tokens, frame.logprobs, frame.final)
        self.state = "done"
        if isinstance(frame, FinishFrame):
            return Finish(reason=frame.reason, usage=Usage(frame.prompt_tokens, frame.completion_tokens,
                                                           frame.cached_tokens), stop_sequence=frame.stop_sequence)
        if isinstance(frame, EmbeddingsFrame):
            return Embeddings(frame.vectors, frame.prompt_tokens)
        raise RemoteError(frame)

    def stream_ended(self) -> None:
        """The peer closed the stream; an error if the response was not complete."""
        if self.state == "open":
            self.state = "done"
            raise UpstreamError("the serving peer closed the tunnel before the response ended")

    @property
    def done(self) -> bool:
        """The response ended (finish, error or cancel): nothing more is expected."""
        return self.state == "done"


class TunnelServer:
    """Serving side of one tunnel stream."""

    def __init__(self, model_sha256: str = "") -> None:
        self.request: RequestFrame | None = None
        self.cancelled = False
        self.done = False
        self.model_sha256 = model_sha256
        """The serving model file's sha256, told to the caller on the first delta."""
        self._told = False

    def receive(self, frame: CallerFrame) -> None:
        """Take a frame from the caller; the first must be the request, and only once."""
        if isinstance(frame, RequestFrame):
            if self.request is not None:
                raise DecodeError("second request frame on one tunnel stream")
            if frame.version != TUNNEL_VERSION:
                raise DecodeError(f"tunnel version {frame.version} is not {TUNNEL_VERSION}")
            self.request = frame
        elif self.request is None:
            raise DecodeError("tunnel stream did not start with a request frame")
        else:
            self.cancelled = True

    def event(self, event: TunnelEvent) -> ServerFrame:
        """The frame for one engine event."""
        self._check_open()
        if isinstance(event, TextDelta):
            sha, self._told = ("" if self._told else self.model_sha256), True
            return DeltaFrame(event.text, event.tokens, event.logprobs, sha, event.final)
        self.done = True
        if isinstance(event, Embeddings):
            return EmbeddingsFrame(event.vectors, event.prompt_tokens)
        return FinishFrame(reason=event.reason, prompt_tokens=event.usage.prompt_tokens,
                           completion_tokens=event.usage.completion_tokens, cached_tokens=event.usage.cached_tokens,
                           stop_sequence=event.stop_sequence)

    def error(self, exc: BaseException) -> ErrorFrame:
        """The frame reporting ``exc`` with the status the caller's client should get."""
        self._check_open()
        self.done = True
        status, body = error_for(exc)
        return ErrorFrame(status=status, code=body["error"]["code"], message=body["error"]["message"],
                          param=body["error"]["param"])

    def _check_open(self) -> None:
        if self.done:
            raise RuntimeError("tunnel response already ended")
