"""Tool calls parsed out of replies (sans-IO): every convention, whole and split at every character."""

from __future__ import annotations

import json

import pytest

from meshllm.api.tools import CallOut, Function, TextOut, ToolCallParser, ToolSpec, json_value_end, parse_calls
from meshllm.runtime.errors import BadRequest

NAMES = frozenset({"get_weather", "get_time"})
WEATHER = '{"name": "get_weather", "arguments": {"city": "Paris"}}'


def parse(text: str, pieces: list[str] | None = None) -> tuple[str, list[tuple[str, dict[str, object]]]]:
    """Text and calls of a reply fed whole or in ``pieces``."""
    parser = ToolCallParser(NAMES)
    events = [e for piece in (pieces or [text]) for e in parser.feed(piece)] + parser.finish()
    text_out = "".join(e.text for e in events if isinstance(e, TextOut))
    calls = [(e.call.name, json.loads(e.call.arguments)) for e in events if isinstance(e, CallOut)]
    assert [e.index for e in events if isinstance(e, CallOut)] == list(range(len(calls)))
    return text_out, calls


REPLIES = {
    "hermes": (f"<tool_call>\n{WEATHER}\n</tool_call>", "", [("get_weather", {"city": "Paris"})]),
    "hermes after text": (f"Let me look.\n<tool_call>{WEATHER}</tool_call>", "Let me look.\n",
                          [("get_weather", {"city": "Paris"})]),
    "two hermes blocks": (f"<tool_call>{WEATHER}</tool_call>\n<tool_call>"
                          '{"name": "get_time", "arguments": {}}</tool_call>\n', "",
                          [("get_weather", {"city": "Paris"}), ("get_time", {})]),
    "hermes left open": (f"<tool_call>{WEATHER}", "", [("get_weather", {"city": "Paris"})]),
    "hermes, arguments as a string": ('<tool_call>{"name": "get_time", "arguments": "{\\"zone\\": \\"UTC\\"}"}'
                                      "</tool_call>", "", [("get_time", {"zone": "UTC"})]),
    "mistral list": (f"[TOOL_CALLS][{WEATHER}]", "", [("get_weather", {"city": "Paris"})]),
    "mistral name[ARGS]": ('[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}', "", [("get_weather", {"city": "Paris"})]),
    "llama 3 python tag": ('<|python_tag|>{"name": "get_time", "parameters": {"zone": "UTC"}}', "",
                           [("get_time", {"zone": "UTC"})]),
    "bare json object": (f"  {WEATHER}", "", [("get_weather", {"city": "Paris"})]),
    "bare json list": (f"[{WEATHER}]", "", [("get_weather", {"city": "Paris"})]),
    "plain text": ("It is sunny in Paris.", "It is sunny in Paris.", []),
    "json that names no offered tool": ('{"name": "rm_rf", "arguments": {}}', '{"name": "rm_rf", "arguments": {}}', []),
    "json answer, not a call": ('{"city": "Paris"}', '{"city": "Paris"}', []),
    "json after text is text": (f"Here: {WEATHER}", f"Here: {WEATHER}", []),
    "broken hermes body stays text": ("<tool_call>{not json}</tool_call> ok", "<tool_call>{not json}</tool_call> ok",
                                      []),
    "a marker's prefix at the end": ("a < b <tool", "a < b <tool", []),
}


@pytest.mark.parametrize("name", sorted(REPLIES))
def test_each_convention_whole_and_split_at_every_character(name: str) -> None:
    reply, text, calls = REPLIES[name]
    assert parse(reply) == (text, calls)
    for cut in range(1, len(reply)):
        assert parse(reply, [reply[:cut], reply[cut:]]) == (text, calls), cut
    assert parse(reply, list(reply)) == (text, calls)


def test_text_is_passed_on_as_soon_as_it_cannot_start_a_marker() -> None:
    parser = ToolCallParser(NAMES)
    assert parser.feed("Hello ") == [TextOut("Hello ")]
    assert parser.feed("<tool") == []  # might be <tool_call>
    assert parser.feed("s>") == [TextOut("<tools>")]


def test_a_reply_starting_with_a_brace_is_held_until_its_json_closes() -> None:
    parser = ToolCallParser(NAMES)
    assert parser.feed('{"name": "get_time", ') == []
    events = parser.feed('"arguments": {}} and more')
    assert isinstance(events[0], CallOut) and events[0].call.name == "get_time"
    assert events[1:] == [TextOut(" and more")]
    assert parser.calls[0].id.startswith("call_")


def test_json_value_end() -> None:
    text = '{"a": "}", "b": [1, {"c": "\\"]"}]} tail'
    assert text[: json_value_end(text, 0)] == '{"a": "}", "b": [1, {"c": "\\"]"}]}'
    assert json_value_end('{"a": [', 0) is None
    assert parse_calls("[]") is None and parse_calls('{"name": ""}') is None


def test_tool_spec_checks_names_and_choices() -> None:
    weather = Function("get_weather")
    with pytest.raises(BadRequest) as exc:
        ToolSpec((weather, weather))
    assert exc.value.param == "tools"
    with pytest.raises(BadRequest):
        ToolSpec((weather,), "get_time")
    with pytest.raises(BadRequest):
        ToolSpec((), "required")
    assert not ToolSpec((weather,), "none").active and ToolSpec((weather,), "none").engine_tools() == ()
    assert ToolSpec((weather,), "get_weather").forced and not ToolSpec((weather,)).forced
    assert ToolSpec((weather,)).parser() is not None and ToolSpec((weather,), "none").parser() is None


@pytest.mark.parametrize(("reply", "text"), [
    ('<tool_call>\n{"name": "get_weather", "argu', ""),
    (f"Sure.\n<tool_call>{WEATHER}</tool_call>\n<tool_call>\n{{\"name\": \"get_ti", "Sure.\n"),
    ('[TOOL_CALLS]get_weather[ARGS]{"city": "Pa', ""),
    ('<|python_tag|>{"name": "get_time", "parameters": {"zo', ""),
    ("It is sunny. <tool_ca", "It is sunny. "),
    ('{"city": "Pa', '{"city": "Pa'),  # a bare JSON answer cut short is still the answer
])
def test_a_call_cut_by_the_length_limit_never_reaches_the_text(reply: str, text: str) -> None:
    for pieces in ([reply], list(reply)):
        parser = ToolCallParser(NAMES)
        events = [e for piece in pieces for e in parser.feed(piece)] + parser.finish(truncated=True)
        assert "".join(e.text for e in events if isinstance(e, TextOut)) == text
        assert len([e for e in events if isinstance(e, CallOut)]) == reply.count("</tool_call>")
