"""The request tunnel: typed frames that carry one request to a peer and its response back.

One bidirectional QUIC stream of kind ``"request"`` per request. The caller sends a
:class:`RequestFrame` (and, if its client goes away, a :class:`CancelFrame`); the server answers
a generation with :class:`DeltaFrame` s and ends with exactly one :class:`FinishFrame` or
:class:`ErrorFrame`; an embedding request is answered by one :class:`EmbeddingsFrame` (or an
error). Fields added since version 1 have defaults, so older peers' frames still decode.

The caller holds a peer's answer to what its request allows (:class:`OutputBudget`): at most the
request's ``max_tokens`` (else the context the peer announced), :data:`BYTES_PER_TOKEN` bytes of
text per token, and no more token-less deltas than tokens. A peer that sends more is cut off with
:class:`PeerOverran` (a 502, so the request fails over or replays elsewhere, and the driver strikes
the peer); a peer can no longer stream without end into the node that routed to it. An error frame
whose status is not an HTTP error status, or whose code is not a plain identifier, is a malformed
answer: the client gets a clean 502, never the peer's status or bytes.

The net layer's streams already frame and decode typed messages (``Stream.send(struct)`` /
``Stream.recv(type)``), so this core works on messages, not bytes: :class:`TunnelClient` and
:class:`TunnelServer` are sans-IO state machines that turn engine events into frames and frames
into engine events or typed errors. They track the stream's state, so a misbehaving peer (a delta
after finish, a second request) is a :class:`~meshllm.errors.DecodeError`, not a corrupt
response. The asyncio driver (``meshllm.runtime.mesh_backend``) only moves their frames.
"""

from __future__ import annotations

import re
from typing import Literal

import msgspec

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
from meshllm.runtime.errors import ApiError, UpstreamError, classify, error_for

TUNNEL_VERSION = 1
BYTES_PER_TOKEN = 256
"""Most bytes of text (and of each logprob entry) one token may bring: the longest tokens of common
vocabularies are 16-128 bytes, and a tail delta may flush a few held-back characters."""
CONTEXT_CAP = 131072
"""Tokens a peer may send for a request without ``max_tokens``: the context its record announces, at most this."""
_CODE = re.compile(r"[a-z0-9_]{1,64}")
MESSAGE_MAX = 2000
"""Characters of a peer's error message passed on (the rest is cut)."""
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


class PeerOverran(UpstreamError):
    """The serving peer sent more than the request allows (tokens, bytes or empty deltas): it is cut off."""


class OutputBudget:
    """What a peer may send for one generation, counted as its deltas arrive (sans-IO)."""

    def __init__(self, max_tokens: int, logprobs: int | None = None) -> None:
        self.max_tokens = max_tokens
        self.per_token = BYTES_PER_TOKEN * (1 if logprobs is None else 2 + logprobs)
        """Bytes per token: its text, and with logprobs its own piece and ``logprobs`` alternatives."""
        self.tokens = 0
        self.bytes = 0
        self.bare = 0
        """Deltas that carried no token ids (a tail flushing held text; an engine that reports none)."""

    @classmethod
    def of(cls, request: GenerationRequest, context: int | None) -> OutputBudget:
        """The budget of ``request`` on a peer announcing ``context`` tokens (0 or None: unknown). A
        replay's engine sends only what follows its continuation, which counts against ``max_tokens``."""
        params = request.params
        limit = params.max_tokens or min(context or CONTEXT_CAP, CONTEXT_CAP)
        return cls(max(0, limit - len(request.continuation)), params.logprobs)

    def take(self, frame: DeltaFrame) -> None:
        """Count ``frame``; :class:`PeerOverran` once the peer has sent more than the request allows."""
        self.tokens += len(frame.tokens)
        self.bare += not frame.tokens
        self.bytes += len(frame.text.encode()) + sum(
            len(lp.piece) + 16 + sum(len(t.piece) + 16 for t in lp.top) for lp in frame.logprobs)
        if self.tokens > self.max_tokens:
            raise PeerOverran(f"sent {self.tokens} tokens for a request of at most {self.max_tokens}")
        if self.bare > self.tokens + 2:
            raise PeerOverran(f"sent {self.bare} deltas without tokens for {self.tokens} tokens")
        if self.bytes > self.per_token * (self.tokens + 1):
            raise PeerOverran(f"sent {self.bytes} bytes for {self.tokens} tokens "
                              f"(at most {self.per_token} per token)")


def checked_error(frame: ErrorFrame) -> ApiError:
    """The client's error for a peer's error frame: the peer's own when well-formed, else a 502."""
    if not (400 <= frame.status <= 599) or not _CODE.fullmatch(frame.code):
        return UpstreamError(f"the serving peer sent a malformed error (status {frame.status!r}, "
                             f"code {frame.code[:64]!r})")
    message, param = (None if text is None else "".join(c if c.isprintable() else " " for c in text[:MESSAGE_MAX])
                      for text in (frame.message, frame.param))
    return RemoteError(ErrorFrame(frame.status, frame.code, message or "", param))


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
        self.budget: OutputBudget | None = None
        """What the peer may send for a generation (None: an embeddings request, answered by one frame)."""
        self.model_sha256 = ""
        """The serving model file's sha256, from the first delta (empty until then, or if the peer did not say)."""

    def start(self, request_id: str, request: Routable, deadline_ms: int, model_sha256: str = "",
              context: int | None = None) -> RequestFrame:
        """The frame to send first (``model_sha256``: only that model file may serve it; ``context``: the
        context the peer announces for the model, which bounds a request without ``max_tokens``)."""
        if self.state != "idle":
            raise RuntimeError("tunnel already started")
        self.state = "open"
        if not isinstance(request, EmbedRequest):
            self.budget = OutputBudget.of(request, context)
        return RequestFrame(request_id=request_id, request=request, deadline_ms=deadline_ms,
                            model_sha256=model_sha256)

    def cancel(self, reason: str = "client disconnected") -> CancelFrame:
        """The frame that asks the server to stop (send it, then close the stream)."""
        self.state = "done"
        return CancelFrame(reason=reason)

    def receive(self, frame: ServerFrame) -> TunnelEvent:
        """The engine event a frame carries; raises the peer's error as :class:`RemoteError` (a malformed
        one as :class:`UpstreamError`), and :class:`PeerOverran` past the budget."""
        if self.state != "open":
            raise DecodeError(f"tunnel peer sent {type(frame).__name__} after the response ended")
        if isinstance(frame, DeltaFrame):
            if self.budget is None:
                raise DecodeError("tunnel peer sent a delta for an embeddings request")
            self.budget.take(frame)
            self.model_sha256 = self.model_sha256 or frame.model_sha256
            return TextDelta(frame.text, frame.tokens, frame.logprobs, frame.final)
        self.state = "done"
        if isinstance(frame, FinishFrame):
            return Finish(reason=frame.reason, usage=Usage(frame.prompt_tokens, frame.completion_tokens,
                                                           frame.cached_tokens), stop_sequence=frame.stop_sequence)
        if isinstance(frame, EmbeddingsFrame):
            return Embeddings(frame.vectors, frame.prompt_tokens)
        raise checked_error(frame)

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
