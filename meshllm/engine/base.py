"""The interface every inference engine implements, and the typed requests and events it speaks.

Requests and events are msgspec structs rather than dataclasses because the same objects travel
to peers inside request-tunnel frames (``meshllm.runtime.tunnel``): a request routed over QUIC is
decoded straight into what the remote engine consumes, with no second schema to keep in step.

Generation is an async iterator of events, ending in exactly one :class:`Finish`. A consumer that
stops iterating early (``aclose()``, or cancellation of its task when an HTTP client goes away)
*is* the cancellation signal: the engine must stop producing tokens promptly, not run on to
``max_tokens`` for nobody.
"""

from __future__ import annotations

import os
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Annotated, Any, Literal

import msgspec
from msgspec import Meta

from meshllm.errors import MeshllmError

if TYPE_CHECKING:
    from meshllm.engine.recommended import Recommended

FinishReason = Literal["stop", "length"]
"""``stop``: end-of-sequence token or a stop string; ``length``: ``max_tokens`` or context full."""
DEFAULT_MAX_CONTEXT = 4096
"""Cap on the context we allocate when the caller does not choose: a 32k KV cache costs GBs."""
DEFAULT_MAX_TOKENS = 1024
"""Tokens generated for a request that sets no ``max_tokens`` (``meshllm serve --max-tokens-default``):
a client that forgets the field must not hold a slot until the context is full."""


def default_threads() -> int:
    """CPU threads for compute when the caller does not choose: the machine's cores, up to 8 (as llama.cpp's
    engine). Every engine uses this one rule."""
    return max(1, min(8, os.cpu_count() or 1))


def context_cap(trained: int, requested: int | None = None, *, cap: int = DEFAULT_MAX_CONTEXT) -> int:
    """Tokens of context an engine allocates per request.

    ``requested`` when the caller chose; else the model's ``trained`` context (``0``: unknown)
    capped at ``cap``.
    """
    return requested or min(trained or cap, cap)


class EngineError(MeshllmError):
    """An engine could not serve a request."""


class PromptTooLong(EngineError):
    """The prompt does not fit the engine's context window (a client error: HTTP 400)."""

    hint = "shorten the prompt or the conversation"


class BadChat(EngineError):
    """The chat template refused the conversation (e.g. roles out of order): a client error."""

    hint = "check the order and roles of the messages"


class InvalidRequest(EngineError):
    """The request asks for something the engine cannot do with it (a client error: HTTP 400)."""


class EngineBusy(EngineError):
    """The engine's queue is full or the request waited too long for its turn (HTTP 503, or 429 once
    every node serving the model is busy)."""

    hint = "retry later, or add nodes serving this model"

    def __init__(self, message: str, *, retry_after_s: float = 1.0) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s
        """When a slot is likely to be free again (the engine's estimate)."""


class Unsupported(EngineError):
    """The engine cannot honour a field of the request (HTTP 400 naming ``param``), rather than ignore it."""

    def __init__(self, message: str, *, param: str | None = None, hint: str | None = None) -> None:
        super().__init__(message, hint)
        self.param = param


class EngineNotLoaded(EngineError):
    """``generate`` was called before ``load`` finished, or after ``close``."""


class SamplingParams(msgspec.Struct, frozen=True, kw_only=True):
    """How the next token is chosen: the one declaration of the sampling fields, shared by the API's
    :class:`GenerationParams`, the split wire (:class:`meshllm.split.frames.Sampling`) and both
    samplers (``engine/sampler.py``, ``engine/llama_sampling.py``), which apply them in llama.cpp's
    order (penalties, top-k, top-p, min-p, temperature, draw)."""

    temperature: float = 1.0
    """0 (or below) is greedy: always the most likely token (deterministic without a seed)."""
    top_p: float = 1.0
    """Keep the smallest set of most likely tokens whose probability reaches top_p; 1 keeps all."""
    top_k: Annotated[int, Meta(ge=0)] | None = None
    """Keep only the k most likely tokens; ``None`` or 0: no top-k cut."""
    min_p: float = 0.0
    """Drop tokens less likely than ``min_p`` times the most likely one (llama.cpp's min-p); 0 keeps all."""
    repeat_penalty: float = 1.0
    """llama.cpp's repetition penalty over the recent tokens: positive logits divided by it, negative
    ones multiplied; 1 is off."""
    presence_penalty: float = 0.0
    """OpenAI: subtract this from the logit of every token seen in the penalty window."""
    frequency_penalty: float = 0.0
    """OpenAI: subtract this times the token's count in the penalty window."""
    seed: int | None = None
    """Same seed, prompt and parameters give the same text on any engine and any chain. The random
    draw of step ``k`` (the ``k``-th generated token) is ``step_uniform(seed, k)``
    (:func:`meshllm.engine.sampler.step_uniform`), so an engine resuming from a
    :attr:`ChatRequest.continuation` of ``k`` tokens draws what the first engine would have."""


class GenerationParams(SamplingParams, frozen=True, kw_only=True):
    """Sampling (:class:`SamplingParams`) and stopping controls shared by chat and text completion."""

    max_tokens: int | None = None
    """Most tokens to generate; ``None``: the serving engine's default cap (:data:`DEFAULT_MAX_TOKENS`
    unless configured). Always clamped to the context left after the prompt."""
    stop: tuple[str, ...] = ()
    """Generation ends *before* the first occurrence of any of these; the stop text is not returned."""
    left_out: tuple[str, ...] = ()
    """Sampling fields the client did not set (``temperature``, ``top_p``, ``top_k``, ``min_p``,
    ``repeat_penalty``): the node that serves the request fills them with the model's recommended
    sampling (:mod:`meshllm.engine.recommended`) before its engine runs it; the values above are
    the fallbacks. ``max_tokens`` left out is ``None``."""
    end_on_repeated_call: bool = False
    """End the reply at a tool call (``<tool_call>`` block) identical to one it already made: set for a
    forced ``tool_choice`` that allows parallel calls, whose grammar would let the model repeat its
    call until ``max_tokens`` (``meshllm.engine.text.RepeatedCallStop``)."""
    grammar: str | None = None
    """A GBNF grammar (llama.cpp syntax, start rule ``root``) that every sampled token must keep the
    text inside; the API builds it from ``response_format`` and ``tool_choice``. ``None``: free text.
    An engine that cannot constrain sampling refuses a request that sets it."""
    logprobs: int | None = None
    """``None``: no log-probabilities; ``k`` (0-20): each generated token's logprob with its ``k`` most
    likely alternatives, on :attr:`TextDelta.logprobs`. They are the model's own distribution (a
    softmax of the raw logits), before penalties, grammar, top-k/top-p and temperature."""


class ToolCall(msgspec.Struct, frozen=True):
    """A function call an assistant turn made (OpenAI's ``tool_calls`` entry, flattened)."""

    id: str
    name: str
    arguments: str
    """The arguments as JSON text, exactly as the model (or the client) wrote them."""


class ChatMessage(msgspec.Struct, frozen=True):
    """One turn of a conversation, content already flattened to text.

    Chat templates read more than role and content: an assistant turn's ``tool_calls``, a tool
    result's ``tool_call_id`` and ``name``. They ride along so the template (or our family format)
    can render them; :func:`meshllm.engine.chat_format.template_message` is the one place that
    turns a message into what templates read.
    """

    role: str
    content: str
    name: str | None = None
    tool_calls: tuple[ToolCall, ...] = ()
    tool_call_id: str | None = None


class ChatRequest(msgspec.Struct, frozen=True, kw_only=True, tag="chat"):
    """Continue a conversation, rendered with the model's chat template."""

    model: str
    messages: tuple[ChatMessage, ...]
    params: GenerationParams = GenerationParams()
    tools: tuple[dict[str, Any], ...] = ()
    """OpenAI tool definitions (``{"type": "function", "function": {...}}``), passed to the chat
    template; a template that knows no tools gets them described in a system message instead."""
    user: str | None = None
    """Client's end-user or session id; routing uses it for affinity."""
    client: str | None = None
    """Who is asking, for fair queueing: ``user:<user>`` or the HTTP connection, set by the node whose
    API took the request (a routed request keeps it). ``None``: one shared anonymous share."""
    continuation: tuple[int, ...] = ()
    """Token ids this request already generated on another engine (failover replay): the engine
    computes their KV after the prompt's as that engine did (one-row decode steps, while they are
    predicted to take at most :data:`REPLAY_STEPS_S`; else a prefill), feeds them silently through
    its text core, and continues after them."""


class CompletionRequest(msgspec.Struct, frozen=True, kw_only=True, tag="completion"):
    """Continue a raw text prompt."""

    model: str
    prompt: str | tuple[int, ...]
    """Text, or token ids fed as they are (OpenAI's token-id prompts)."""
    params: GenerationParams = GenerationParams()
    user: str | None = None
    client: str | None = None
    """As :attr:`ChatRequest.client`."""
    continuation: tuple[int, ...] = ()
    """As :attr:`ChatRequest.continuation`."""


class EmbedRequest(msgspec.Struct, frozen=True, kw_only=True, tag="embed"):
    """Pooled hidden states of each input (``/v1/embeddings``)."""

    model: str
    inputs: tuple[str | tuple[int, ...], ...]
    """Texts, or token ids fed as they are."""
    user: str | None = None
    """As :attr:`ChatRequest.user` (routing affinity)."""


GenerationRequest = ChatRequest | CompletionRequest


class Usage(msgspec.Struct, frozen=True):
    """Token counts in the engine's own tokenization."""

    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0
    """Prompt tokens whose KV came from a prompt cache instead of being computed."""

    @property
    def total_tokens(self) -> int:
        """Prompt plus completion, as OpenAI reports it."""
        return self.prompt_tokens + self.completion_tokens


class TopLogprob(msgspec.Struct, frozen=True):
    """One candidate token at a position and its log-probability."""

    token_id: int
    piece: bytes
    """The token's bytes (may be part of a UTF-8 character)."""
    logprob: float


class TokenLogprob(msgspec.Struct, frozen=True):
    """A generated token's log-probability and the most likely alternatives at its position."""

    token_id: int
    piece: bytes
    logprob: float
    top: tuple[TopLogprob, ...] = ()


class TextDelta(msgspec.Struct, frozen=True, tag="delta"):
    """The next piece of generated text (whole UTF-8 characters, never a split byte sequence)."""

    text: str
    tokens: tuple[int, ...] = ()
    """Token ids fed to the text core since the previous delta (their text may be partly held back
    by a stop-string match); concatenated over a stream they are the request's continuation."""
    logprobs: tuple[TokenLogprob, ...] = ()
    """One entry per token of ``tokens`` when the request asked for logprobs."""
    final: bool = False
    """The tail: text held back until the end (half a character, a possible stop string's start); only
    the :class:`Finish` follows. A replay after it must not send that text again."""


class Finish(msgspec.Struct, frozen=True, tag="finish"):
    """The last event of a generation."""

    reason: FinishReason
    usage: Usage
    stop_sequence: str | None = None
    """The stop string that ended generation (``reason`` is ``stop``); ``None`` for an end-of-sequence token."""


GenerationEvent = TextDelta | Finish


class Embeddings(msgspec.Struct, frozen=True, tag="embeddings"):
    """The answer to an :class:`EmbedRequest`: one float32 vector per input, in input order."""

    vectors: tuple[bytes, ...]
    """Little-endian float32 values (what llama.cpp computes; OpenAI's base64 encoding is these bytes)."""
    prompt_tokens: int


class LoadReport(msgspec.Struct, frozen=True, kw_only=True):
    """How busy an engine is; gossiped as the node's load and used by the router."""

    running: int
    """Requests generating now (each holds one slot)."""
    slots: int = 1
    """Requests that can generate at once (``--parallel``); ``slots - running`` are free."""
    queued: int
    """Requests waiting for their turn."""
    max_queue: int
    """Queue depth at which new requests are refused with :class:`EngineBusy`."""
    tokens_per_s: float
    """Recent decode speed (exponential average); 0 before the first request."""


REPLAY_STEPS_S = 2.0
"""The longest an engine spends computing a continuation in one-row decode steps, as the engine that
began the request computed it, before it prefills the tokens instead: exact against quick, since
ggml's attention takes another kernel for one query row than for several, and on SmolLM2-135M a
prefill of the sent tokens changed the greedy text (docs/architecture.md, "replay")."""


class TokenRate:
    """Recent decode speed as an exponential average: what :attr:`LoadReport.tokens_per_s` reports."""

    ALPHA = 0.3
    """Weight of the newest request: recent enough for routing, smooth enough to ignore one outlier."""

    def __init__(self) -> None:
        self.value = 0.0

    def observe(self, generated: int, started: float, now: float) -> None:
        """Fold in one request that produced ``generated`` tokens between ``started`` and ``now``."""
        elapsed = now - started
        if generated and elapsed > 0:
            speed = generated / elapsed
            self.value = speed if not self.value else (1 - self.ALPHA) * self.value + self.ALPHA * speed


GRAMMAR = "grammar"
"""Capability: honours :attr:`GenerationParams.grammar`."""
LOGPROBS = "logprobs"
"""Capability: honours :attr:`GenerationParams.logprobs`."""
TOKEN_PROMPTS = "token_prompts"
"""Capability: takes :attr:`CompletionRequest.prompt` as token ids."""


class Engine(ABC):
    """One loaded model that generates text. Implementations run blocking work off the loop."""

    model_id: str
    """The API id this engine serves (see ``meshllm.models.refs``)."""
    recommended: Recommended | None = None
    """The model's recommended sampling, filled into what a request leaves out (set by the node that
    loads the engine; :func:`meshllm.engine.recommended.admit`)."""
    supports: frozenset[str] = frozenset()
    """Optional request features this engine honours (:data:`GRAMMAR`, :data:`LOGPROBS`,
    :data:`TOKEN_PROMPTS`); :func:`check_supported` refuses the others before ``generate``."""

    @abstractmethod
    async def load(self) -> None:
        """Load the model; raises an :class:`EngineError` (or subclass) that says why not."""

    @abstractmethod
    async def close(self) -> None:
        """Cancel what is running and free the model."""

    @property
    @abstractmethod
    def context_length(self) -> int:
        """Tokens of context each request may use (prompt plus completion)."""

    @abstractmethod
    def load_report(self) -> LoadReport:
        """Current load; cheap, called on every gossip round and routing decision."""

    @abstractmethod
    def generate(self, request: GenerationRequest) -> AsyncIterator[GenerationEvent]:
        """Stream events for ``request``; errors before the first event mean nothing was sent.

        Closing the iterator early cancels the generation between two tokens.
        """

    @property
    def native_tools(self) -> bool:
        """Whether the model's chat template renders tools itself (otherwise they are emulated)."""
        return False

    def speculation_status(self) -> dict[str, object] | None:
        """Speculative decoding figures for ``/api/status`` (``None``: this engine does not speculate itself)."""
        return None

    @property
    def listed(self) -> bool:
        """Whether ``/v1/models`` lists the model now (a split model only once its chain can serve)."""
        return True


def check_supported(engine: Engine, request: GenerationRequest) -> None:
    """Raise :class:`Unsupported` naming the first field of ``request`` that ``engine`` cannot honour.

    Every place that hands a request to an engine (local backends, the tunnel's serving end) calls
    this first, so a field is refused the same way wherever the request runs.
    """
    params = request.params
    if params.grammar is not None and GRAMMAR not in engine.supports:
        raise Unsupported(f"model {engine.model_id} cannot constrain sampling with a grammar on this node "
                          "(a JSON response_format or a forced tool_choice needs it)", param="response_format")
    if params.logprobs is not None and LOGPROBS not in engine.supports:
        raise Unsupported(f"model {engine.model_id} cannot report logprobs on this node", param="logprobs")
    if isinstance(request, CompletionRequest) and not isinstance(request.prompt, str) \
            and TOKEN_PROMPTS not in engine.supports:
        raise Unsupported(f"model {engine.model_id} cannot take token-id prompts on this node", param="prompt")
