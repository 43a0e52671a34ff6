"""Structured output, logprobs and forced tool calls on a split chain and on ``--engine ggml``, with the
official ``openai`` client against real nodes started through the CLI.

Three servers of the same tool model (``tinymodels.write_tiny_tool_model`` with two blocks, so it
splits, and calls that repeat until something ends the turn): a solo llama.cpp node (the reference), a
solo ``--engine ggml`` node, and a 2-stage chain (a ``--split force`` coordinator and a ``--worker``
that fetches its layers as a stage file and reads the vocabulary for the grammar from it). Every greedy
answer of the chain and of the ggml node must equal the llama.cpp node's; logprobs must agree within
float tolerance (the runtimes compute the same logits; on this f32 model they can differ in the last
bits).
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import httpx
import openai
import pytest
from nodes import NodeProcess, running_nodes, wait_until
from prometheus_client.parser import text_string_to_metric_families
from tinymodels import TOOL_MODEL, TOOL_MODEL_REPLY, write_tiny_tool_model

pytestmark = [pytest.mark.timeout(300)]

T = TypeVar("T")
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["city", "days", "sunny", "kind"],
          "properties": {"city": {"type": "string", "maxLength": 12}, "days": {"type": "integer"},
                         "sunny": {"type": "boolean"}, "kind": {"enum": ["rain", "sun"]}}}
JSON_SCHEMA = {"type": "json_schema", "json_schema": {"name": "weather", "schema": SCHEMA, "strict": True}}
# after a tool result the model would answer "OK": only the grammar makes it call again
DONE: list[Any] = [*ASK, {"role": "assistant", "tool_calls": [{"id": "call_1", "type": "function", "function": {
    "name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "18 C"}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, NodeProcess]]:
    """``llama`` (reference), ``ggml`` and ``split`` (the chain's coordinator), each answering for the model."""
    tmp = tmp_path_factory.mktemp("structured")
    gguf = write_tiny_tool_model(tmp / f"{TOOL_MODEL}.gguf", blocks=2, repeat_calls=True)
    with running_nodes() as nodes:
        llama = NodeProcess(tmp / "llama", ["--model", str(gguf), "--threads", "1"], "llama")
        ggml = NodeProcess(tmp / "ggml", ["--model", str(gguf), "--engine", "ggml", "--threads", "1"], "ggml")
        coord = NodeProcess(tmp / "c", ["--model", str(gguf), "--split", "force", "--stages", "2", "--threads", "1"],
                            "coord")
        nodes += [llama, ggml, coord]
        token = coord.wait_ready()["invite"]
        worker = NodeProcess(tmp / "w", ["--worker", "--join", token, "--threads", "1"], "w")
        nodes.append(worker)
        ready = coord.wait_event(lambda e: e["type"] == "split_ready" and len(e["stages"]) == 2, 120.0)
        assert ready["model"] == TOOL_MODEL
        llama.wait_ready()
        ggml.wait_ready()
        worker.wait_ready()
        models = worker.home / "models"  # the last stage has only its stage file to read the vocabulary from
        assert not list(models.glob("*.gguf")) and len(list((models / "stages").glob("*.gguf"))) == 1
        yield {"llama": llama, "ggml": ggml, "split": coord}


def client(node: NodeProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{node.api}/v1", api_key="unused", max_retries=0, timeout=60)


def ask(node: NodeProcess, call: Callable[[openai.OpenAI], T], attempts: int = 4) -> T:
    """``call`` against ``node``; a chain that missed a stage deadline on this loaded host answers 503
    while it replans: wait for it to be ready and ask again (any other error fails the test)."""
    for attempt in range(attempts):
        try:
            return call(client(node))
        except openai.APIStatusError as exc:
            if exc.status_code != 503 or attempt == attempts - 1:
                raise
            wait_until(lambda: all(s["state"] == "ready" for s in node.status()["splits"]), 60.0, interval=0.2)
    raise AssertionError("unreachable")


def _chain_passes(coord: NodeProcess) -> int:
    """Decode passes the coordinator's chain has run (its speculation counters count every pass)."""
    (split,) = coord.status()["splits"]
    return int(split["speculation"]["passes"])


def check_weather(text: str) -> dict[str, Any]:
    """The JSON parses and validates against SCHEMA (checked by hand: no schema library is a dependency)."""
    value = json.loads(text)
    assert isinstance(value, dict) and set(value) == {"city", "days", "sunny", "kind"}, value
    assert isinstance(value["city"], str) and len(value["city"]) <= 12
    assert isinstance(value["days"], int) and not isinstance(value["days"], bool)
    assert isinstance(value["sunny"], bool) and value["kind"] in ("rain", "sun")
    return value


@pytest.mark.parametrize("engine", ["split", "ggml"])
def test_json_schema_output_validates_and_equals_llama(servers: dict[str, NodeProcess], engine: str) -> None:
    def create(c: openai.OpenAI) -> str:
        reply = c.chat.completions.create(model=TOOL_MODEL, messages=ASK, response_format=JSON_SCHEMA,  # type: ignore
                                          temperature=0, max_tokens=200)
        assert reply.choices[0].finish_reason == "stop"
        return reply.choices[0].message.content or ""

    expected = ask(servers["llama"], create)
    check_weather(expected)
    passes = _chain_passes(servers["split"])
    text = ask(servers[engine], create)
    check_weather(text)
    assert text == expected
    if engine == "split":  # the chain answered, not some other engine of the coordinator
        assert _chain_passes(servers["split"]) > passes

    def streamed(c: openai.OpenAI) -> str:
        chunks = c.chat.completions.create(model=TOOL_MODEL, messages=ASK, response_format=JSON_SCHEMA,  # type: ignore
                                           temperature=0, max_tokens=200, stream=True)
        return "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)

    assert ask(servers[engine], streamed) == expected
    json_object = ask(servers[engine], lambda c: c.chat.completions.create(
        model=TOOL_MODEL, messages=ASK, response_format={"type": "json_object"}, temperature=0,  # type: ignore
        max_tokens=100).choices[0].message.content or "")
    assert isinstance(json.loads(json_object), dict)


def _close(mine: list[float], theirs: list[float]) -> None:
    assert mine == pytest.approx(theirs, abs=1e-3)


@pytest.mark.parametrize("engine", ["split", "ggml"])
def test_logprobs_with_top_3_equal_llama(servers: dict[str, NodeProcess], engine: str) -> None:
    def chat(c: openai.OpenAI) -> list[Any]:
        reply = c.chat.completions.create(model=TOOL_MODEL, messages=ASK, logprobs=True, top_logprobs=3,  # type: ignore
                                          temperature=0)
        assert reply.choices[0].message.content == TOOL_MODEL_REPLY and reply.choices[0].logprobs is not None
        return reply.choices[0].logprobs.content or []

    expected, got = ask(servers["llama"], chat), ask(servers[engine], chat)
    assert [t.token for t in got] == [t.token for t in expected] == ["O", "K"]
    for mine, theirs in zip(got, expected, strict=True):
        assert len(mine.top_logprobs) == 3 and mine.bytes == theirs.bytes
        assert [t.token for t in mine.top_logprobs] == [t.token for t in theirs.top_logprobs]
        _close([mine.logprob, *(t.logprob for t in mine.top_logprobs)],
               [theirs.logprob, *(t.logprob for t in theirs.top_logprobs)])

    def complete(c: openai.OpenAI) -> Any:
        return c.completions.create(model=TOOL_MODEL, prompt="abc", max_tokens=12, logprobs=3,
                                    temperature=0).choices[0]

    ref, ours = ask(servers["llama"], complete), ask(servers[engine], complete)
    assert ours.text == ref.text == "defghijklmno"
    assert ours.logprobs.tokens == ref.logprobs.tokens
    _close(ours.logprobs.token_logprobs, ref.logprobs.token_logprobs)
    for mine_top, ref_top in zip(ours.logprobs.top_logprobs, ref.logprobs.top_logprobs, strict=True):
        assert list(mine_top) == list(ref_top) and len(mine_top) == 3
        _close(list(mine_top.values()), list(ref_top.values()))


@pytest.mark.parametrize("engine", ["split", "ggml"])
def test_a_named_tool_choice_forces_a_call(servers: dict[str, NodeProcess], engine: str) -> None:
    def forced(c: openai.OpenAI) -> list[tuple[str, dict[str, Any]]]:
        reply = c.chat.completions.create(model=TOOL_MODEL, messages=DONE, tools=[WEATHER],  # type: ignore[arg-type]
                                          tool_choice=NAMED, temperature=0)  # type: ignore[arg-type]
        assert reply.choices[0].finish_reason == "tool_calls"
        return [(t.function.name, json.loads(t.function.arguments)) for t in reply.choices[0].message.tool_calls or []]

    expected = ask(servers["llama"], forced)
    calls = ask(servers[engine], forced)
    assert calls == expected and calls and all(name == "get_weather" and "city" in args for name, args in calls)
    free = ask(servers[engine], lambda c: c.chat.completions.create(model=TOOL_MODEL, messages=DONE,  # type: ignore
                                                                    tools=[WEATHER]).choices[0].message.content)
    assert free == TOOL_MODEL_REPLY  # without the grammar the model would not have called


def test_metrics_count_split_requests(servers: dict[str, NodeProcess]) -> None:
    """The coordinator's ``/metrics`` counts a chain's requests under ``route="split"``, its tokens,
    and the stage-lane bytes that carried them (parsed with prometheus_client's own parser)."""
    coord = servers["split"]

    def scrape() -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
        text = httpx.get(coord.api + "/metrics", headers=coord.admin_headers, timeout=10).text
        return {(s.name, frozenset(s.labels.items())): s.value
                for f in text_string_to_metric_families(text) for s in f.samples}

    def grew(name: str, **labels: str) -> float:
        key = (name, frozenset(labels.items()))
        return after.get(key, 0.0) - before.get(key, 0.0)

    split = {"model": TOOL_MODEL, "route": "split"}
    before = scrape()
    reply = ask(coord, lambda c: c.chat.completions.create(model=TOOL_MODEL, messages=ASK, max_tokens=8))
    after = scrape()
    retries = grew("meshllm_request_errors_total", route="split")  # a 503 while the chain replans: asked again
    assert grew("meshllm_requests_total", **split) == 1 + retries
    assert reply.usage is not None
    assert grew("meshllm_tokens_total", kind="completion", **split) == reply.usage.completion_tokens
    assert grew("meshllm_time_to_first_token_seconds_count", **split) >= 1
    assert grew("meshllm_stream_bytes_total", kind="stage-lane", direction="sent") > 0


@pytest.mark.parametrize("engine", ["llama", "ggml", "split"])
def test_forced_calls_with_parallel_calls_allowed_end_after_one_call(servers: dict[str, NodeProcess],
                                                                     engine: str) -> None:
    """The grammar of a forced call allows more calls; the model repeats its call, and the repeat ends the turn.
    A call cut by ``max_tokens`` leaves no markup in the content."""
    for choice, messages in itertools.product(("required", NAMED), (ASK, DONE)):
        def forced(c: openai.OpenAI, max_tokens: int | None = None, choice: Any = choice,
                   messages: list[Any] = messages) -> Any:
            return c.chat.completions.create(model=TOOL_MODEL, messages=messages, tools=[WEATHER],  # type: ignore
                                             tool_choice=choice, parallel_tool_calls=True, temperature=0,
                                             max_tokens=max_tokens).choices[0]

        whole = ask(servers[engine], forced)
        [call] = whole.message.tool_calls or []
        assert whole.finish_reason == "tool_calls" and not whole.message.content
        assert call.function.name == "get_weather" and "city" in json.loads(call.function.arguments)
        cut = ask(servers[engine], lambda c: forced(c, max_tokens=3))
        assert cut.finish_reason == "length" and not cut.message.content and not cut.message.tool_calls

    response = ask(servers[engine], lambda c: c.responses.create(
        model=TOOL_MODEL, input="What is the weather in Paris?", tools=[{  # type: ignore[list-item]
            "type": "function", "name": "get_weather", "parameters": WEATHER["function"]["parameters"]}],  # type: ignore[index]
        tool_choice="required", parallel_tool_calls=True, temperature=0))
    assert [o.type for o in response.output] == ["function_call"]
