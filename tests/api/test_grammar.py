"""Grammars from response_format and tool_choice, checked against llama.cpp's own grammar sampler.

llama-cpp-python's ``create_completion(grammar=...)`` runs llama.cpp's grammar sampler on the tiny
tool model, so these tests show that each grammar parses in llama.cpp and that what it lets the
model write is what the API promises (JSON that validates, calls that parse), independently of
the engine that serves the API.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from llama_cpp import Llama, LlamaGrammar

from meshllm.api.grammar import MAX_GRAMMAR_CHARS, build_grammar
from meshllm.api.tools import Function, TextOut, ToolCallParser, ToolSpec
from meshllm.runtime.errors import BadRequest

PLAIN = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
WITH_TOOLS = "<|im_start|>system\n<tools>\n<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
WEATHER = Function("get_weather", "Weather now", {"type": "object", "required": ["city", "days"], "properties": {
    "city": {"type": "string"}, "days": {"type": "integer"}}})
CLOCK = Function("get_time", None, {"type": "object", "required": ["zone"], "properties": {
    "zone": {"type": "string", "enum": ["UTC", "CET"]}}})
SCHEMA = {"type": "object", "required": ["name", "tags", "kind", "ok"], "additionalProperties": False, "properties": {
    "name": {"type": "string", "maxLength": 8}, "tags": {"type": "array", "items": {"type": "string"}},
    "kind": {"enum": ["cat", "dog"]}, "ok": {"type": "boolean"}}}


@pytest.fixture(scope="module")
def llama(tool_gguf: Path) -> Iterator[Llama]:
    model = Llama(str(tool_gguf), n_ctx=1024, n_threads=1, verbose=False)
    yield model
    model.close()


def sample(llama: Llama, grammar: str, prompt: str = PLAIN) -> str:
    out: Any = llama.create_completion(prompt, grammar=LlamaGrammar.from_string(grammar, verbose=False),
                                       max_tokens=300, temperature=0)
    assert out["choices"][0]["finish_reason"] == "stop"  # the grammar let the model finish
    return str(out["choices"][0]["text"])


def calls_in(text: str) -> list[tuple[str, dict[str, Any]]]:
    parser = ToolCallParser(frozenset({"get_weather", "get_time"}))
    events = parser.feed(text) + parser.finish()
    assert not [e for e in events if isinstance(e, TextOut)], text
    return [(c.name, json.loads(c.arguments)) for c in parser.calls]


def test_free_text_needs_no_grammar() -> None:
    assert build_grammar(ToolSpec(()), None) is None
    assert build_grammar(ToolSpec((WEATHER,)), {"type": "text"}) is None


def test_json_object_gives_a_json_object(llama: Llama) -> None:
    assert isinstance(json.loads(sample(llama, build_grammar(ToolSpec(()), {"type": "json_object"}) or "")), dict)


@pytest.mark.parametrize("prompt", [PLAIN, WITH_TOOLS])
def test_json_schema_output_validates(llama: Llama, prompt: str) -> None:
    grammar = build_grammar(ToolSpec(()), {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}})
    value = json.loads(sample(llama, grammar or "", prompt))
    assert set(value) == {"name", "tags", "kind", "ok"}
    assert isinstance(value["name"], str) and len(value["name"]) <= 8
    assert all(isinstance(t, str) for t in value["tags"]) and value["kind"] in ("cat", "dog")
    assert isinstance(value["ok"], bool)


def test_the_responses_api_flat_format_works_the_same(llama: Llama) -> None:
    grammar = build_grammar(ToolSpec(()), {"type": "json_schema", "name": "x", "schema": SCHEMA}, "text.format")
    assert json.loads(sample(llama, grammar or ""))["kind"] in ("cat", "dog")


@pytest.mark.parametrize("prompt", [PLAIN, WITH_TOOLS])
def test_required_tool_choice_forces_a_call_with_valid_arguments(llama: Llama, prompt: str) -> None:
    calls = calls_in(sample(llama, build_grammar(ToolSpec((WEATHER, CLOCK), "required"), None) or "", prompt))
    assert calls
    for name, args in calls:
        if name == "get_weather":
            assert isinstance(args["city"], str) and isinstance(args["days"], int)
        else:
            assert name == "get_time" and args["zone"] in ("UTC", "CET")


def test_named_tool_choice_forces_that_function(llama: Llama) -> None:
    for prompt in (PLAIN, WITH_TOOLS):  # the model "wants" get_weather with tools listed
        calls = calls_in(sample(llama, build_grammar(ToolSpec((WEATHER, CLOCK), "get_time"), None) or "", prompt))
        assert [name for name, _ in calls] == ["get_time"] * len(calls) and calls


def test_one_call_only_without_parallel_tool_calls() -> None:
    grammar = build_grammar(ToolSpec((WEATHER,), "required", parallel=False), None) or ""
    assert "tool-calls ::= tool-call\n" in grammar + "\n"


def test_auto_tool_choice_with_a_format_allows_either(llama: Llama) -> None:
    grammar = build_grammar(ToolSpec((WEATHER, CLOCK)), {"type": "json_object"}) or ""
    assert grammar.startswith("root ::= tool-calls | ")
    assert calls_in(sample(llama, grammar, WITH_TOOLS))  # the tool model calls when tools are listed
    text = sample(llama, grammar, PLAIN)
    assert (text.startswith("<tool_call>") and calls_in(text)) or isinstance(json.loads(text), dict)


def test_strings_hold_no_raw_control_characters() -> None:
    grammar = build_grammar(ToolSpec(()), {"type": "json_object"}) or ""
    assert "\\x00-\\x1F" in grammar


@pytest.mark.parametrize(("fmt", "param"), [
    ({"type": "xml"}, "response_format.type"),
    ({"type": "json_schema", "json_schema": {"schema": "not a schema"}}, "response_format.json_schema.schema"),
    ({"type": "json_schema", "json_schema": {"schema": {"$ref": "https://example.com/s.json"}}},
     "response_format.json_schema.schema"),
])
def test_schemas_that_cannot_become_grammars_are_400s(fmt: dict[str, Any], param: str) -> None:
    with pytest.raises(BadRequest) as exc:
        build_grammar(ToolSpec(()), fmt)
    assert exc.value.param == param


def test_a_tool_schema_that_cannot_become_a_grammar_names_the_tool() -> None:
    with pytest.raises(BadRequest) as exc:
        build_grammar(ToolSpec((Function("f", None, {"$ref": "#/nowhere"}),), "required"), None)
    assert exc.value.param == "tools[0].parameters"


def test_strict_schemas_refuse_keywords_sampling_cannot_enforce() -> None:
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 1}}}
    with pytest.raises(BadRequest) as exc:
        build_grammar(ToolSpec(()), {"type": "json_schema", "json_schema": {"schema": schema, "strict": True}})
    assert exc.value.param == "response_format.json_schema.schema" and "minimum" in str(exc.value)
    assert build_grammar(ToolSpec(()), {"type": "json_schema", "json_schema": {"schema": schema}})  # best effort
    with pytest.raises(BadRequest) as exc:
        build_grammar(ToolSpec((Function("f", None, schema, strict=True),), "required"), None)
    assert exc.value.param == "tools[0].parameters"
    assert build_grammar(ToolSpec((Function("f", None, {"enum": [{"minimum": 1}]}, strict=True),), "required"), None)


def test_huge_grammars_are_refused() -> None:
    schema = {"type": "object", "properties": {f"p{i}" + "x" * 1000: {"type": "string"} for i in range(300)}}
    with pytest.raises(BadRequest) as exc:
        build_grammar(ToolSpec(()), {"type": "json_schema", "json_schema": {"schema": schema}})
    assert str(MAX_GRAMMAR_CHARS) in str(exc.value)
