"""The official ``openai`` client against real nodes: chat with tools, n, embeddings, completions, Responses.

Every test runs twice (the ``surface`` fixture): against the node serving the tool model, and
against a ``--client`` node that routes each request over the mesh to it. The tool model's
replies are fixed by construction (``tinymodels.write_tiny_tool_model``): ``OK``, or a call of
``get_weather`` when tools are listed and no result came back yet.

Tests of features the serving engine must implement (grammars, logprobs, token-id prompts) run
when the llama engine declares them in ``Engine.supports`` and are skipped, saying so, otherwise.
"""

from __future__ import annotations

import base64
import json
from array import array
from typing import Any

import openai
import pytest
from tinymodels import TOOL_MODEL, TOOL_MODEL_REPLY

from meshllm.engine.base import GRAMMAR, LOGPROBS, TOKEN_PROMPTS
from meshllm.engine.llama import LlamaEngine

pytestmark = pytest.mark.timeout(180)

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def needs(feature: str) -> pytest.MarkDecorator:
    return pytest.mark.skipif(feature not in LlamaEngine.supports,
                              reason=f"the llama engine does not implement {feature} yet (Engine.supports)")


@pytest.fixture
def client(surface: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{surface}/v1", api_key="unused", max_retries=0, timeout=60)


def test_plain_chat_and_system_messages_reach_the_model(client: openai.OpenAI) -> None:
    bare = client.chat.completions.create(model=TOOL_MODEL, messages=ASK)  # type: ignore[arg-type]
    assert bare.choices[0].message.content == TOOL_MODEL_REPLY and bare.choices[0].finish_reason == "stop"
    system = "Answer in French."
    told = client.chat.completions.create(model=TOOL_MODEL, messages=[  # type: ignore[arg-type]
        {"role": "system", "content": system}, {"role": "developer", "content": system}, *ASK])
    assert bare.usage is not None and told.usage is not None
    # One token per byte: both instructions are in the prompt, not dropped.
    assert told.usage.prompt_tokens - bare.usage.prompt_tokens >= 2 * len(system)


def test_a_full_tool_round_trip(client: openai.OpenAI) -> None:
    first = client.chat.completions.create(model=TOOL_MODEL, messages=ASK, tools=[WEATHER])  # type: ignore[arg-type]
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    [call] = choice.message.tool_calls or []
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}
    history: list[Any] = [*ASK, choice.message.model_dump(exclude_none=True),
                          {"role": "tool", "tool_call_id": call.id, "content": '{"temp_c": 18}'}]
    second = client.chat.completions.create(model=TOOL_MODEL, messages=history, tools=[WEATHER])
    assert second.choices[0].message.content == TOOL_MODEL_REPLY
    assert second.choices[0].finish_reason == "stop" and not second.choices[0].message.tool_calls


def test_tool_calls_stream_as_openai_deltas(client: openai.OpenAI) -> None:
    chunks = list(client.chat.completions.create(model=TOOL_MODEL, messages=ASK, tools=[WEATHER],  # type: ignore
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    deltas = [d for c in chunks if c.choices for d in c.choices[0].delta.tool_calls or []]
    head, *rest = deltas
    assert head.index == 0 and head.id and head.type == "function" and head.function is not None
    assert head.function.name == "get_weather" and head.function.arguments == ""
    arguments = "".join(d.function.arguments or "" for d in rest if d.function is not None)
    assert json.loads(arguments) == {"city": "Paris"} and all(d.id is None for d in rest)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens > 0


def test_tool_choice_none_gives_text(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(model=TOOL_MODEL, messages=ASK, tools=[WEATHER],  # type: ignore[arg-type]
                                           tool_choice="none")
    assert reply.choices[0].message.content == TOOL_MODEL_REPLY and reply.choices[0].finish_reason == "stop"


def test_n_choices_whole_and_streamed(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(model=TOOL_MODEL, messages=ASK, n=2, seed=5)  # type: ignore[arg-type]
    assert [c.index for c in reply.choices] == [0, 1]
    assert [c.message.content for c in reply.choices] == [TOOL_MODEL_REPLY] * 2
    assert reply.usage is not None and reply.usage.completion_tokens == 2 * 2  # "O", "K" each
    chunks = list(client.chat.completions.create(model=TOOL_MODEL, messages=ASK, n=2, stream=True))  # type: ignore
    for index in (0, 1):
        mine = [c.choices[0] for c in chunks if c.choices and c.choices[0].index == index]
        assert "".join(c.delta.content or "" for c in mine) == TOOL_MODEL_REPLY
        assert mine[-1].finish_reason == "stop"


@needs(GRAMMAR)
def test_forced_tool_choice_calls_even_when_the_model_would_not(client: openai.OpenAI) -> None:
    done: list[Any] = [*ASK, {"role": "assistant", "tool_calls": [{"id": "call_1", "type": "function", "function": {
        "name": "get_weather", "arguments": '{"city": "Paris"}'}}]}, {"role": "tool", "tool_call_id": "call_1",
                                                                      "content": "18 C"}]
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        reply = client.chat.completions.create(model=TOOL_MODEL, messages=done, tools=[WEATHER],
                                               tool_choice=choice)  # type: ignore[arg-type]
        calls = reply.choices[0].message.tool_calls or []
        assert reply.choices[0].finish_reason == "tool_calls" and calls
        assert all(c.function.name == "get_weather" and "city" in json.loads(c.function.arguments) for c in calls)


@needs(GRAMMAR)
def test_json_schema_output_parses_and_validates(client: openai.OpenAI) -> None:
    schema = {"type": "object", "additionalProperties": False, "required": ["city", "sunny"], "properties": {
        "city": {"type": "string", "enum": ["Paris", "Rome"]}, "sunny": {"type": "boolean"}}}
    reply = client.chat.completions.create(model=TOOL_MODEL, messages=ASK, response_format={  # type: ignore
        "type": "json_schema", "json_schema": {"name": "weather", "schema": schema, "strict": True}})
    value = json.loads(reply.choices[0].message.content or "")
    assert set(value) == {"city", "sunny"} and value["city"] in ("Paris", "Rome") and isinstance(value["sunny"], bool)
    reply = client.chat.completions.create(model=TOOL_MODEL, messages=ASK,  # type: ignore[arg-type]
                                           response_format={"type": "json_object"})
    assert isinstance(json.loads(reply.choices[0].message.content or ""), dict)


@needs(LOGPROBS)
def test_chat_logprobs(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(model=TOOL_MODEL, messages=ASK, logprobs=True,  # type: ignore[arg-type]
                                           top_logprobs=3)
    content = reply.choices[0].logprobs.content if reply.choices[0].logprobs else None
    assert content is not None and "".join(t.token for t in content) == TOOL_MODEL_REPLY
    for token in content:
        assert token.logprob <= 0 and len(token.top_logprobs) == 3 and token.bytes == list(token.token.encode())
        assert token.top_logprobs[0].logprob >= token.top_logprobs[-1].logprob


def test_embeddings(client: openai.OpenAI) -> None:
    out = client.embeddings.create(model=TOOL_MODEL, input=["Paris in spring", "Paris in spring", "Rome"])
    vectors = [d.embedding for d in out.data]
    assert [d.index for d in out.data] == [0, 1, 2] and len({len(v) for v in vectors}) == 1
    assert vectors[0] == vectors[1] and vectors[0] != vectors[2]
    assert abs(sum(x * x for x in vectors[0]) - 1) < 1e-4  # normalised
    assert out.usage.prompt_tokens > 0
    packed = client.embeddings.create(model=TOOL_MODEL, input="Rome", encoding_format="base64").data[0].embedding
    assert array("f", base64.b64decode(packed)).tolist() == pytest.approx(vectors[2], abs=1e-6)  # type: ignore[arg-type]
    ids = client.embeddings.create(model=TOOL_MODEL, input=[[1, 85, 114, 112, 104]]).data[0].embedding
    assert len(ids) == len(vectors[0])
    with pytest.raises(openai.BadRequestError, match="dimensions"):
        client.embeddings.create(model=TOOL_MODEL, input="x", dimensions=3)


def test_completions_with_several_prompts_and_choices(client: openai.OpenAI) -> None:
    reply = client.completions.create(model=TOOL_MODEL, prompt=["ab", "xy"], n=2, max_tokens=4, temperature=0)
    assert [c.index for c in reply.choices] == [0, 1, 2, 3]
    assert [c.text for c in reply.choices] == ["cdef", "cdef", "zabc", "zabc"]  # letters count on, z wraps to a
    assert reply.usage is not None and reply.usage.completion_tokens == 16
    streamed = list(client.completions.create(model=TOOL_MODEL, prompt=["ab", "xy"], max_tokens=4, stream=True))
    texts = ["".join(c.choices[0].text for c in streamed if c.choices and c.choices[0].index == i) for i in (0, 1)]
    assert texts == ["cdef", "zabc"]


@needs(TOKEN_PROMPTS)
def test_token_id_prompts(client: openai.OpenAI) -> None:
    reply = client.completions.create(model=TOOL_MODEL, prompt=[[1, 3 + ord("a")], [1, 3 + ord("x")]], max_tokens=3)
    assert [c.text for c in reply.choices] == ["bcd", "yza"]


@needs(LOGPROBS)
def test_completion_logprobs(client: openai.OpenAI) -> None:
    reply = client.completions.create(model=TOOL_MODEL, prompt="ab", max_tokens=3, logprobs=2)
    lp = reply.choices[0].logprobs
    assert lp is not None and lp.tokens == ["c", "d", "e"] and lp.text_offset == [0, 1, 2]
    assert lp.top_logprobs is not None and all(len(t) == 2 for t in lp.top_logprobs)


def test_responses_text_and_stream(client: openai.OpenAI) -> None:
    response = client.responses.create(model=TOOL_MODEL, instructions="Be brief.", input="Hello there")
    assert response.status == "completed" and response.output_text == TOOL_MODEL_REPLY
    assert response.usage is not None and response.usage.output_tokens == 2
    assert client.responses.retrieve(response.id).output_text == TOOL_MODEL_REPLY
    with client.responses.stream(model=TOOL_MODEL, input="Hello there") as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_response()
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    assert "response.output_text.delta" in kinds and "response.output_item.done" in kinds
    assert final.output_text == TOOL_MODEL_REPLY


def test_responses_function_tools_round_trip(client: openai.OpenAI) -> None:
    tool = {"type": "function", "name": "get_weather", "parameters": WEATHER["function"]["parameters"]}
    first = client.responses.create(model=TOOL_MODEL, input="Weather in Paris?", tools=[tool])  # type: ignore
    [call] = [item for item in first.output if item.type == "function_call"]
    assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "Paris"}
    follow = client.responses.create(model=TOOL_MODEL, previous_response_id=first.id, tools=[tool],  # type: ignore
                                     input=[{"type": "function_call_output", "call_id": call.call_id,
                                             "output": "18 C"}])
    assert follow.output_text == TOOL_MODEL_REPLY
    # The same conversation sent in full (store=false, as Codex does) gives the same answer.
    full = client.responses.create(model=TOOL_MODEL, tools=[tool], store=False, input=[  # type: ignore[arg-type]
        {"role": "user", "content": "Weather in Paris?"},
        {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
        {"type": "function_call_output", "call_id": call.call_id, "output": "18 C"}])
    assert full.output_text == TOOL_MODEL_REPLY
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(full.id)
    with client.responses.stream(model=TOOL_MODEL, input="Weather?", tools=[tool]) as stream:  # type: ignore
        kinds = [event.type for event in stream]
        final = stream.get_final_response()
    assert "response.function_call_arguments.done" in kinds and final.output[0].type == "function_call"


@pytest.mark.skipif(GRAMMAR in LlamaEngine.supports, reason="the llama engine honours grammars now")
def test_a_format_the_serving_engine_cannot_honour_is_a_400_naming_it(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model=TOOL_MODEL, messages=ASK,  # type: ignore[arg-type]
                                       response_format={"type": "json_object"})
    assert refused.value.code == "unsupported_parameter" and refused.value.param == "response_format"
