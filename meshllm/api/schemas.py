"""OpenAI request and response bodies (pydantic: validated at the HTTP edge), and their engine requests.

A field the request body does not know is a 400 naming it (``unknown_parameter``), as OpenAI and
Anthropic answer, never ignored; the bodies list every field of the current API references. Fields
we know are either honoured or refused with a 400 that names them (``param``): :func:`refuse` lists
the ones no engine can honour (``logit_bias``, audio output, predicted outputs...). Objects inside a
body (messages, content parts, tools) ignore keys they do not know: clients send back the messages
a response gave them, with its extra keys (``refusal``, ``annotations``...). Bounds mirror OpenAI's documented
ranges; ``seed`` is limited to 64 bits because requests travel to peers as msgpack.

The Responses API and Anthropic's Messages API have their own bodies (``meshllm.api.responses``,
``meshllm.api.anthropic``) but build the same engine requests through the same helpers:
:func:`params`, :class:`~meshllm.api.tools.ToolSpec`, :func:`~meshllm.api.grammar.build_grammar`.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from pydantic import BaseModel, ConfigDict, Field, field_validator

from meshllm.api.grammar import build_grammar
from meshllm.api.tools import NO_TOOLS, Choice, ToolSpec, function
from meshllm.engine.base import ChatMessage, ChatRequest, CompletionRequest, GenerationParams, ToolCall
from meshllm.runtime.errors import BadRequest

MAX_STOP = 4
MAX_N = 16
"""Most choices (``n``) or prompts x choices one request may ask for."""
MAX_TOP_LOGPROBS = 20
I64_MIN, I64_MAX = -(2**63), 2**63 - 1
Role = Literal["system", "developer", "user", "assistant", "tool"]


class Lenient(BaseModel):
    """An object inside a request body: keys it does not know are ignored (echoed response objects)."""

    model_config = ConfigDict(extra="ignore")


class RequestBody(BaseModel):
    """A top-level request body: a field it does not know is a 400 naming it, not silently dropped."""

    model_config = ConfigDict(extra="forbid")


def clean(text: str) -> str:
    """Replace lone surrogates (valid in JSON escapes, not encodable as UTF-8) with U+FFFD."""
    return text.encode("utf-8", "surrogatepass").decode("utf-8", "replace")


def refuse(body: BaseModel, why: dict[str, str]) -> None:
    """400 for the first field of ``why`` the client set to something other than its neutral value."""
    for name, reason in why.items():
        value = getattr(body, name, None)
        if value not in (None, False, [], {}, ""):
            raise BadRequest(f"{name} is not supported: {reason}", param=name)


def travels(value: Any, what: str, param: str | None = None) -> None:
    """Refuse what msgpack cannot carry to a peer (integers beyond 64 bits in a schema, say).

    Inside a pydantic validator (``param`` None) this is a ``ValueError`` (a 422 naming the field);
    elsewhere a 400 naming ``param``.
    """
    try:
        msgspec.msgpack.encode(value)
    except (OverflowError, TypeError, ValueError) as exc:
        message = f"{what} cannot be sent to the serving node: {exc}"
        if param is None:
            raise ValueError(message) from None
        raise BadRequest(message, param=param) from None


def params(*, max_tokens: int | None, temperature: float | None, top_p: float | None = None,
           top_k: int | None = None, min_p: float | None = None, repeat_penalty: float | None = None,
           seed: int | None = None, stop: tuple[str, ...] = (),
           presence_penalty: float | None = None, frequency_penalty: float | None = None,
           grammar: str | None = None, logprobs: int | None = None,
           end_on_repeated_call: bool = False) -> GenerationParams:
    """Engine sampling parameters: what the client set, OpenAI's defaults (temperature 1, top_p 1)
    elsewhere, and the names of the sampling fields it left out, which the serving node fills with
    the model's recommendation (:mod:`meshllm.engine.recommended`)."""
    given = {"temperature": temperature, "top_p": top_p, "top_k": top_k, "min_p": min_p,
             "repeat_penalty": repeat_penalty}
    return GenerationParams(
        max_tokens=max_tokens, temperature=1.0 if temperature is None else temperature,
        top_p=1.0 if top_p is None else top_p, top_k=top_k, seed=seed,
        min_p=0.0 if min_p is None else min_p, repeat_penalty=1.0 if repeat_penalty is None else repeat_penalty,
        left_out=tuple(name for name, value in given.items() if value is None),
        stop=tuple(clean(s) for s in stop if s), presence_penalty=presence_penalty or 0.0,
        frequency_penalty=frequency_penalty or 0.0, grammar=grammar, logprobs=logprobs,
        end_on_repeated_call=end_on_repeated_call)


def choice_seed(seed: int | None, index: int) -> int | None:
    """Choice ``index`` of ``n`` gets ``seed + index`` (wrapping in 64 bits): same seed, same n choices."""
    if seed is None or index == 0:
        return seed
    return (seed + index - I64_MIN) % 2**64 + I64_MIN


# ---- chat ---------------------------------------------------------------------------------------

class ContentPart(Lenient):
    """A part of a multi-part message; text models take ``text`` parts only."""

    type: str
    text: str | None = None


class FunctionCallIn(Lenient):
    """A call's function and its arguments (JSON text)."""

    name: str
    arguments: str = "{}"


class ToolCallIn(Lenient):
    """An assistant message's earlier tool call."""

    id: str = Field(max_length=256)
    type: Literal["function"] = "function"
    function: FunctionCallIn


class ChatMessageIn(Lenient):
    """One message; ``content`` as a string or a list of text parts."""

    role: Role
    content: str | list[ContentPart] | None = None
    name: str | None = Field(default=None, max_length=256)
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = Field(default=None, max_length=256)


class FunctionDef(Lenient):
    """A function a tool offers."""

    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = Field(default=None, description="refuse schema keywords sampling cannot enforce")


class ToolIn(Lenient):
    """A tool: only ``function`` tools exist for a local model."""

    type: str = "function"
    function: FunctionDef


class NamedFunction(Lenient):
    name: str


class NamedToolChoice(Lenient):
    """``{"type": "function", "function": {"name": ...}}``: this function must be called."""

    type: Literal["function"] = "function"
    function: NamedFunction


class JsonSchemaFormat(Lenient):
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(Lenient):
    """``text``, ``json_object`` or ``json_schema`` (both JSON kinds by grammar-constrained sampling)."""

    type: Literal["text", "json_object", "json_schema"] = "text"
    json_schema: JsonSchemaFormat | None = None

    def as_dict(self) -> dict[str, Any] | None:
        if self.type == "json_schema":
            if self.json_schema is None:
                raise BadRequest("response_format.json_schema is required for type json_schema",
                                 param="response_format.json_schema")
            return {"type": "json_schema", "json_schema": {"schema": self.json_schema.schema_ or {"type": "object"},
                                                           "strict": self.json_schema.strict}}
        return {"type": self.type}


class StreamOptions(Lenient):
    """``include_usage``: send a last chunk with ``usage`` and no choices."""

    include_usage: bool = False


class _SamplingFields(RequestBody):
    """Fields shared by chat and text completions."""

    model: str = Field(min_length=1, max_length=512)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, ge=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=0, le=1_000_000, description="meshllm extension: top-k cut")
    min_p: float | None = Field(default=None, ge=0.0, le=1.0, description="meshllm extension (llama.cpp's min-p)")
    repeat_penalty: float | None = Field(default=None, gt=0.0, le=10.0,
                                         description="meshllm extension (llama.cpp's repetition penalty; 1: off)")
    seed: int | None = Field(default=None, ge=I64_MIN, le=I64_MAX)
    stop: str | Annotated[list[str], Field(max_length=MAX_STOP)] | None = Field(
        default=None, description=f"a stop string or up to {MAX_STOP}")
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int | None = Field(default=None, ge=1, le=MAX_N, description=f"choices to generate (at most {MAX_N})")
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = None
    user: str | None = Field(default=None, max_length=512)
    safety_identifier: str | None = Field(default=None, max_length=512,
                                          description="as user: the client's key for its fair share")
    metadata: dict[str, str] | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = Field(default=None, max_length=512,
                                         description="accepted: prompt caching is automatic, keyed by the prompt")

    def client_key(self) -> str | None:
        """``user``, else ``safety_identifier``: whose fair share of the queue the request takes."""
        key = self.user or self.safety_identifier
        return clean(key) if key else None

    def refuse_common(self) -> None:
        """400 for the shared fields no engine can honour."""
        refuse(self, {"logit_bias": "token biases are not applied by this server",
                      "metadata": "completions are not stored, so there is nothing to tag"})
        if self.service_tier not in (None, "auto", "default"):
            raise BadRequest("service_tier: only auto or default (one tier)", param="service_tier")

    def stops(self) -> tuple[str, ...]:
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())

    @property
    def include_usage(self) -> bool:
        """Whether a streamed response ends with a usage chunk."""
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def choices(self) -> int:
        return self.n or 1


class ChatCompletionRequest(_SamplingFields):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessageIn] = Field(min_length=1, max_length=10_000)
    max_tokens: int | None = Field(default=None, ge=1, le=I64_MAX,
                                   description="default: the serving node's cap (meshllm serve --max-tokens-default)")
    max_completion_tokens: int | None = Field(default=None, ge=1, le=I64_MAX)
    tools: list[ToolIn] | None = Field(default=None, max_length=128)
    tool_choice: Literal["auto", "none", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    functions: list[FunctionDef] | None = Field(default=None, max_length=128, description="deprecated: tools")
    function_call: Literal["auto", "none"] | NamedFunction | None = Field(
        default=None, description="deprecated: tool_choice")
    response_format: ResponseFormat | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    audio: dict[str, Any] | None = None
    modalities: list[str] | None = None
    prediction: dict[str, Any] | None = None
    web_search_options: dict[str, Any] | None = None
    reasoning_effort: str | None = None
    verbosity: str | None = None
    store: bool | None = None

    @field_validator("tools", "functions")
    @classmethod
    def _tools_travel(cls, tools: list[Any] | None) -> list[Any] | None:
        """Tools ride along when the request is routed to a peer."""
        if tools:
            travels([t.model_dump() for t in tools], "tools")
        return tools

    @field_validator("response_format")
    @classmethod
    def _format_travels(cls, fmt: ResponseFormat | None) -> ResponseFormat | None:
        if fmt is not None:
            travels(fmt.model_dump(by_alias=True), "response_format")
        return fmt

    def tool_spec(self) -> ToolSpec:
        """Tools and how they may be used (the deprecated ``functions`` work the same way)."""
        if self.tools and self.functions:
            raise BadRequest("send tools or the deprecated functions, not both", param="functions")
        functions = []
        for i, tool in enumerate(self.tools or ()):
            if tool.type != "function":
                raise BadRequest(f"tools[{i}].type {tool.type!r} is not supported (only function tools)",
                                 param=f"tools[{i}].type")
            fn = tool.function
            functions.append(function(fn.name, fn.description, fn.parameters, f"tools[{i}].function", fn.strict))
        for i, fn in enumerate(self.functions or ()):
            functions.append(function(fn.name, fn.description, fn.parameters, f"functions[{i}]"))
        picked = self.tool_choice if self.tool_choice is not None else self.function_call
        choice: Choice
        if picked is None or isinstance(picked, str):
            choice = picked or "auto"
        elif isinstance(picked, NamedToolChoice):
            choice = picked.function.name
        else:
            choice = picked.name
        if not functions and choice == "auto":
            return NO_TOOLS
        return ToolSpec(tuple(functions), choice, parallel=self.parallel_tool_calls is not False)

    def engine_messages(self) -> tuple[ChatMessage, ...]:
        """The conversation as the engine takes it; a part we cannot feed a text model is a 400."""
        out = []
        for i, m in enumerate(self.messages):
            calls = tuple(ToolCall(id=clean(c.id), name=clean(c.function.name), arguments=clean(c.function.arguments))
                          for c in m.tool_calls or ())
            if calls and m.role != "assistant":
                raise BadRequest(f"messages[{i}]: only assistant messages carry tool_calls",
                                 param=f"messages[{i}].tool_calls")
            if m.role == "tool" and not m.tool_call_id:
                raise BadRequest(f"messages[{i}]: a tool message needs the tool_call_id it answers",
                                 param=f"messages[{i}].tool_call_id")
            out.append(ChatMessage(role=m.role, content=clean(content_text(m.content, f"messages[{i}].content")),
                                   name=clean(m.name) if m.name else None, tool_calls=calls,
                                   tool_call_id=clean(m.tool_call_id) if m.tool_call_id else None))
        return tuple(out)

    def to_engine(self, tools: ToolSpec | None = None) -> list[ChatRequest]:
        """One engine request per choice; raises :class:`BadRequest` for what we cannot honour.

        ``tools`` is :meth:`tool_spec` when the caller already has it.
        """
        self.refuse_common()
        refuse(self, {"audio": "text models only", "prediction": "predicted outputs are not used",
                      "web_search_options": "no web search", "reasoning_effort": "not a reasoning model",
                      "verbosity": "the length of the answer follows max_tokens and the prompt",
                      "store": "completions are not stored"})
        if self.modalities not in (None, ["text"]):
            raise BadRequest("modalities: only ['text']", param="modalities")
        if self.top_logprobs is not None and not self.logprobs:
            raise BadRequest("top_logprobs needs logprobs: true", param="top_logprobs")
        tools = self.tool_spec() if tools is None else tools
        fmt = self.response_format.as_dict() if self.response_format else None
        grammar = build_grammar(tools, fmt)
        messages = self.engine_messages()
        return [ChatRequest(
            model=self.model, messages=messages,
            params=params(max_tokens=self.max_completion_tokens or self.max_tokens, temperature=self.temperature,
                          top_p=self.top_p, top_k=self.top_k, min_p=self.min_p, repeat_penalty=self.repeat_penalty,
                          seed=choice_seed(self.seed, i), stop=self.stops(),
                          presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
                          grammar=grammar, logprobs=(self.top_logprobs or 0) if self.logprobs else None,
                          end_on_repeated_call=tools.repeats_end),
            tools=tools.engine_tools(), user=self.client_key(),
        ) for i in range(self.choices)]


def content_text(content: str | list[ContentPart] | None, where: str) -> str:
    """A message's text; any part that is not text is refused (these are text models)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    texts = []
    for j, part in enumerate(content):
        if part.type not in ("text", "input_text", "output_text") or part.text is None:
            raise BadRequest(f"{where}[{j}]: content of type {part.type!r} is not supported (text models only)",
                             param=f"{where}[{j}].type")
        texts.append(part.text)
    return "".join(texts)


# ---- completions --------------------------------------------------------------------------------

TokenIds = Annotated[list[Annotated[int, Field(ge=0, le=2**31 - 1)]], Field(min_length=1, max_length=1_000_000)]
"""Token ids (the engine checks them against its vocabulary)."""


class CompletionRequestIn(_SamplingFields):
    """``POST /v1/completions``."""

    prompt: str | TokenIds | Annotated[list[str], Field(min_length=1, max_length=MAX_N)] | Annotated[
        list[TokenIds], Field(min_length=1, max_length=MAX_N)] = Field(
        description="a string, token ids, or a list of either (one completion each)")
    max_tokens: int | None = Field(default=16, ge=1, le=I64_MAX, description="OpenAI's default is 16")
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = Field(default=None, ge=1, le=MAX_N, description="only equal to n")
    logprobs: int | None = Field(default=None, ge=0, le=5)

    def prompts(self) -> list[str | tuple[int, ...]]:
        """Each prompt of the request: text or token ids."""
        p = self.prompt
        if isinstance(p, str):
            return [clean(p)]
        if p and all(isinstance(x, int) for x in p):
            return [tuple(p)]  # type: ignore[arg-type]
        return [clean(x) if isinstance(x, str) else tuple(x) for x in p]  # type: ignore[union-attr]

    def to_engine(self) -> list[CompletionRequest]:
        """One engine request per prompt and choice (OpenAI's order: prompt-major)."""
        self.refuse_common()
        refuse(self, {"suffix": "fill-in-the-middle is not supported"})
        if self.best_of is not None and self.best_of != self.choices:
            raise BadRequest("best_of: only equal to n (choices are not ranked)", param="best_of")
        prompts = self.prompts()
        if len(prompts) * self.choices > MAX_N:
            raise BadRequest(f"{len(prompts)} prompts x n={self.choices} is more than {MAX_N} completions",
                             param="n")
        if self.echo and any(not isinstance(p, str) for p in prompts):
            raise BadRequest("echo is not supported with token-id prompts", param="echo")
        if self.echo and self.logprobs is not None:
            raise BadRequest("echo with logprobs (prompt logprobs) is not supported", param="echo")
        return [CompletionRequest(
            model=self.model, prompt=prompt,
            params=params(max_tokens=self.max_tokens, temperature=self.temperature, top_p=self.top_p,
                          top_k=self.top_k, min_p=self.min_p, repeat_penalty=self.repeat_penalty,
                          seed=choice_seed(self.seed, j), stop=self.stops(),
                          presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
                          logprobs=self.logprobs),
            user=self.client_key(),
        ) for prompt in prompts for j in range(self.choices)]


# ---- responses (the shapes /openapi.json documents; the routes build them) ----------------------

class PromptTokensDetails(BaseModel):
    """``cached_tokens``: prompt tokens the serving engine took from its prompt cache."""

    cached_tokens: int = 0


class UsageOut(BaseModel):
    """Token counts."""

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails = Field(default_factory=PromptTokensDetails)


class TopLogprobOut(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprobOut(TopLogprobOut):
    top_logprobs: list[TopLogprobOut]


class ChatLogprobs(BaseModel):
    content: list[TokenLogprobOut] | None = None
    refusal: list[TokenLogprobOut] | None = None


class FunctionCallOut(BaseModel):
    name: str
    arguments: str


class ToolCallOut(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCallOut


class AssistantMessage(BaseModel):
    """The generated message: text, or tool calls (and any text before them)."""

    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCallOut] | None = None
    refusal: None = None


FinishReasonOut = Literal["stop", "length", "tool_calls"]


class ChatChoice(BaseModel):
    """One choice of a chat completion."""

    index: int = 0
    message: AssistantMessage
    finish_reason: FinishReasonOut
    logprobs: ChatLogprobs | None = None


class ChatCompletion(BaseModel):
    """Non-streamed chat completion."""

    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: UsageOut
    system_fingerprint: str | None = None


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]] | None
    text_offset: list[int]


class CompletionChoice(BaseModel):
    """A text completion choice (streamed chunks use the same shape)."""

    index: int = 0
    text: str
    finish_reason: Literal["stop", "length"] | None = None
    logprobs: CompletionLogprobs | None = None


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
