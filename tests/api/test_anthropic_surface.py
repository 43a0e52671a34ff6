"""The official ``anthropic`` client against real nodes (local and routed): messages, streaming, tool use."""

from __future__ import annotations

from typing import Any

import anthropic
import httpx
import pytest
from tinymodels import TOOL_MODEL, TOOL_MODEL_REPLY

pytestmark = pytest.mark.timeout(180)

WEATHER = {"name": "get_weather", "description": "Current weather in a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
ASK: list[Any] = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture
def client(surface: str) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=surface, api_key="unused", max_retries=0, timeout=60)


def test_message_with_system(client: anthropic.Anthropic) -> None:
    bare = client.messages.create(model=TOOL_MODEL, max_tokens=32, messages=ASK)
    told = client.messages.create(model=TOOL_MODEL, max_tokens=32, messages=ASK,
                                  system=[{"type": "text", "text": "Answer in French.",
                                           "cache_control": {"type": "ephemeral"}}])
    for message in (bare, told):
        assert message.type == "message" and message.role == "assistant" and message.stop_reason == "end_turn"
        assert [(b.type, getattr(b, "text", None)) for b in message.content] == [("text", TOOL_MODEL_REPLY)]
    assert told.usage.input_tokens - bare.usage.input_tokens >= len("Answer in French.")
    assert bare.usage.output_tokens == 2


def test_max_tokens_and_stop_sequences(client: anthropic.Anthropic) -> None:
    cut = client.messages.create(model=TOOL_MODEL, max_tokens=1, messages=ASK)
    assert cut.stop_reason == "max_tokens" and cut.content[0].type == "text" and cut.content[0].text == "O"
    stopped = client.messages.create(model=TOOL_MODEL, max_tokens=32, messages=ASK, stop_sequences=["K", "Z"])
    assert stopped.stop_reason == "stop_sequence" and stopped.stop_sequence == "K"


def test_streamed_text(client: anthropic.Anthropic) -> None:
    with client.messages.stream(model=TOOL_MODEL, max_tokens=32, messages=ASK) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == TOOL_MODEL_REPLY and final.stop_reason == "end_turn" and final.usage.output_tokens == 2


def test_tool_use_round_trip_streamed_and_not(client: anthropic.Anthropic) -> None:
    first = client.messages.create(model=TOOL_MODEL, max_tokens=64, messages=ASK, tools=[WEATHER])  # type: ignore
    assert first.stop_reason == "tool_use"
    [use] = [b for b in first.content if b.type == "tool_use"]
    assert use.name == "get_weather" and use.input == {"city": "Paris"} and use.id.startswith("toolu_")
    with client.messages.stream(model=TOOL_MODEL, max_tokens=64, messages=ASK, tools=[WEATHER]) as stream:  # type: ignore
        kinds = [event.type for event in stream]
        streamed = stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop" and "input_json" in kinds
    assert streamed.stop_reason == "tool_use" and streamed.content[0].type == "tool_use"
    assert streamed.content[0].input == {"city": "Paris"}
    history: list[Any] = [*ASK, {"role": "assistant", "content": first.content},
                          {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                                        "content": [{"type": "text", "text": "18 C"}]}]}]
    second = client.messages.create(model=TOOL_MODEL, max_tokens=64, messages=history, tools=[WEATHER])  # type: ignore
    assert second.stop_reason == "end_turn" and second.content[0].type == "text"
    assert second.content[0].text == TOOL_MODEL_REPLY


def test_count_tokens(client: anthropic.Anthropic) -> None:
    counted = client.messages.count_tokens(model=TOOL_MODEL, messages=ASK)
    sent = client.messages.create(model=TOOL_MODEL, max_tokens=8, messages=ASK)
    assert counted.input_tokens == sent.usage.input_tokens


def test_errors_have_anthropics_shape(client: anthropic.Anthropic, surface: str) -> None:
    with pytest.raises(anthropic.NotFoundError) as missing:
        client.messages.create(model="no-such-model", max_tokens=8, messages=ASK)
    assert missing.value.body["error"]["type"] == "not_found_error"  # type: ignore[index]
    for body, status in (({"model": TOOL_MODEL, "messages": ASK}, 422),  # no max_tokens
                         ({"model": TOOL_MODEL, "max_tokens": 8, "thinking": {"type": "enabled", "budget_tokens": 9},
                           "messages": ASK}, 400),
                         ({"model": TOOL_MODEL, "max_tokens": 8, "messages": [
                             {"role": "user", "content": [{"type": "image", "source": {}}]}]}, 400)):
        response = httpx.post(f"{surface}/v1/messages", json=body, timeout=30)
        assert response.status_code == status, response.text
        assert response.json()["type"] == "error"
        assert response.json()["error"]["type"] == "invalid_request_error" and response.json()["error"]["message"]
