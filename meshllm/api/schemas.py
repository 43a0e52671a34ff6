"""Request and response bodies in OpenAI's shapes (pydantic: validated at the HTTP edge).

Unknown request fields are ignored, as OpenAI-compatible servers commonly do, so clients written
for newer API versions keep working; fields we know but cannot honour (``n`` > 1, logprobs, a
``suffix``) are refused with a 400 that names them rather than silently ignored. Bounds mirror
OpenAI's documented ranges, and ``seed`` is limited to 64 bits because requests travel to peers
as msgpack.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from pydantic import BaseModel, ConfigDict, Field, field_validator

from meshllm.api.errors import BadRequest
from meshllm.engine.base import ChatMessage, ChatRequest, CompletionRequest, GenerationParams

MAX_STOP = 4
I64_MIN, I64_MAX = -(2**63), 2**63 - 1
Role = Literal["system", "developer", "user", "assistant", "tool"]


class _Lenient(BaseModel):
    model_config = ConfigDict(extra="ignore")


class TextPart(_Lenient):
    """A text part of a multi-part message (the only kind a text model takes)."""

    type: Literal["text"]
    text: str


class ChatMessageIn(_Lenient):
    """One message; ``content`` as a string or a list of text parts."""

    role: Role
    content: str | list[TextPart] | None = None
    name: str | None = None


class StreamOptions(_Lenient):
    """``include_usage``: send a last chunk with ``usage`` and no choices."""

    include_usage: bool = False


class _SamplingFields(_Lenient):
    """Fields shared by chat and text completions."""

    model: str = Field(min_length=1, max_length=512)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, ge=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=0, le=1_000_000, description="meshllm extension: top-k cut")
    seed: int | None = Field(default=None, ge=I64_MIN, le=I64_MAX)
    stop: str | Annotated[list[str], Field(max_length=MAX_STOP)] | None = Field(
        default=None, description=f"a stop string or up to {MAX_STOP}")
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int | None = Field(default=None, ge=1, le=1, description="only one choice per request")
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    logprobs: Literal[False] | None = Field(default=None, description="not supported")
    user: str | None = Field(default=None, max_length=512)

    def _params(self, max_tokens: int | None) -> GenerationParams:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return GenerationParams(
            max_tokens=max_tokens,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=self.top_k,
            seed=self.seed,
            stop=tuple(clean(s) for s in stops if s),
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
        )

    @property
    def include_usage(self) -> bool:
        """Whether a streamed response ends with a usage chunk."""
        return bool(self.stream_options and self.stream_options.include_usage)


class ChatCompletionRequest(_SamplingFields):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessageIn] = Field(min_length=1, max_length=10_000)
    max_tokens: int | None = Field(default=None, ge=1, le=I64_MAX,
                                   description="default: the serving node's cap (meshllm serve --max-tokens-default)")
    max_completion_tokens: int | None = Field(default=None, ge=1, le=I64_MAX)
    tools: list[dict[str, Any]] | None = None

    @field_validator("tools")
    @classmethod
    def _tools_travel(cls, tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
        """Tools ride along when the request is routed to a peer: refuse what msgpack cannot carry."""
        try:
            msgspec.msgpack.encode(tools)
        except (OverflowError, TypeError, ValueError) as exc:
            raise ValueError(f"tools cannot be sent to the serving node: {exc}") from None
        return tools
    response_format: dict[str, Any] | None = None

    def to_engine(self) -> ChatRequest:
        """The engine's request; raises :class:`BadRequest` for what we cannot honour."""
        if self.response_format and self.response_format.get("type", "text") != "text":
            raise BadRequest("response_format other than text is not supported")
        messages = tuple(ChatMessage(role=m.role, content=clean(_text(m.content))) for m in self.messages)
        return ChatRequest(
            model=self.model,
            messages=messages,
            params=self._params(self.max_completion_tokens or self.max_tokens),
            tools=tuple(self.tools or ()),
            user=clean(self.user) if self.user else None,
        )


class CompletionRequestIn(_SamplingFields):
    """``POST /v1/completions``."""

    prompt: str | Annotated[list[str], Field(min_length=1, max_length=1)] = Field(
        description="a string, or a list holding exactly one string")
    max_tokens: int | None = Field(default=16, ge=1, le=I64_MAX, description="OpenAI's default is 16")
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = Field(default=None, ge=1, le=1, description="only 1")

    def to_engine(self) -> CompletionRequest:
        """The engine's request; raises :class:`BadRequest` for what we cannot honour."""
        prompt = self.prompt[0] if isinstance(self.prompt, list) else self.prompt
        if self.suffix:
            raise BadRequest("suffix (fill-in-the-middle) is not supported")
        return CompletionRequest(model=self.model, prompt=clean(prompt), params=self._params(self.max_tokens),
                                 user=clean(self.user) if self.user else None)


def _text(content: str | list[TextPart] | None) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join(part.text for part in content)


def clean(text: str) -> str:
    """Replace lone surrogates (valid in JSON escapes, not encodable as UTF-8) with U+FFFD."""
    return text.encode("utf-8", "surrogatepass").decode("utf-8", "replace")


# ---- responses -----------------------------------------------------------------------------

class PromptTokensDetails(BaseModel):
    """``cached_tokens``: prompt tokens the serving engine took from its prompt cache."""

    cached_tokens: int = 0


class UsageOut(BaseModel):
    """Token counts."""

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails = Field(default_factory=PromptTokensDetails)


class AssistantMessage(BaseModel):
    """The generated message."""

    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    """One (the only) choice of a chat completion."""

    index: int = 0
    message: AssistantMessage
    finish_reason: Literal["stop", "length"]
    logprobs: None = None


class ChatCompletion(BaseModel):
    """Non-streamed chat completion."""

    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: UsageOut


class CompletionChoice(BaseModel):
    """A text completion choice (streamed chunks use the same shape)."""

    index: int = 0
    text: str
    finish_reason: Literal["stop", "length"] | None = None
    logprobs: None = None


class Completion(BaseModel):
    """A text completion, or one chunk of a streamed one."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageOut | None = None


class ModelOut(BaseModel):
    """An entry of ``/v1/models``; ``nodes`` is meshllm's addition."""

    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "meshllm"
    nodes: list[str] = Field(default_factory=list, description="ids of the nodes serving this model")
    node_names: list[str] = Field(default_factory=list, description="names of the same nodes, in the same order")
    context_length: int | None = None


class ModelList(BaseModel):
    """``GET /v1/models``."""

    object: Literal["list"] = "list"
    data: list[ModelOut]


class ErrorDetail(BaseModel):
    """What went wrong."""

    message: str
    type: str
    code: str | None = None
    param: str | None = None


class ErrorResponse(BaseModel):
    """Every error response."""

    error: ErrorDetail
