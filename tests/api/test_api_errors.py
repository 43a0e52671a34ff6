"""OpenAI-shaped errors, limits, and cancellation when the client goes away."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import openai
import pytest
from api_server import serve
from fastapi import APIRouter, Depends
from nodes import wait_until

from meshllm.api.app import ApiLimits, LocalBackend, ModelEntry, create_app
from meshllm.api.auth import require_api_key
from meshllm.engine.base import Finish, GenerationEvent, GenerationRequest, TextDelta, Usage
from meshllm.engine.llama import LlamaEngine
from meshllm.runtime.errors import NoCapacity

CHAT = "/v1/chat/completions"
HELLO = {"model": "tiny-llama", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4}


def assert_openai_error(response: httpx.Response, status: int, code: str | None = None) -> dict[str, Any]:
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json")
    error = response.json()["error"]
    assert set(error) >= {"message", "type", "code"}
    assert error["message"] and "Traceback" not in error["message"]
    if code is not None:
        assert error["code"] == code
    return error


def test_unknown_model_is_404(tiny_server: str) -> None:
    response = httpx.post(tiny_server + CHAT, json={**HELLO, "model": "nope"})
    assert "nope" in assert_openai_error(response, 404, "model_not_found")["message"]
    client = openai.OpenAI(base_url=f"{tiny_server}/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="x")
    assert_openai_error(httpx.get(tiny_server + "/v1/models/nope"), 404, "model_not_found")


def test_bad_json_is_400(tiny_server: str) -> None:
    response = httpx.post(tiny_server + CHAT, content=b'{"model": ', headers={"content-type": "application/json"})
    assert_openai_error(response, 400, "invalid_json")


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"model": "tiny-llama"}, "messages"),
        ({"messages": [{"role": "user", "content": "x"}]}, "model"),
        ({**HELLO, "temperature": 9}, "temperature"),
        ({**HELLO, "messages": [{"role": "wizard", "content": "x"}]}, "messages.0.role"),
        ({**HELLO, "n": 17}, "n"),
        ({**HELLO, "stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ],
)
def test_missing_or_invalid_fields_are_422(tiny_server: str, body: dict[str, Any], param: str) -> None:
    error = assert_openai_error(httpx.post(tiny_server + CHAT, json=body), 422, "invalid_value")
    assert error["param"] == param and error["message"].startswith(param)


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        (CHAT, {**HELLO, "logit_bias": {"5": 1.0}}, "logit_bias"),
        (CHAT, {**HELLO, "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
         "messages[0].content[0].type"),
        (CHAT, {**HELLO, "tools": [{"type": "web_search", "function": {"name": "f"}}]}, "tools[0].type"),
        (CHAT, {**HELLO, "tools": [{"type": "function", "function": {"name": "bad name"}}]},
         "tools[0].function.name"),
        (CHAT, {**HELLO, "tools": [{"type": "function", "function": {"name": "f"}}],
                "tool_choice": {"type": "function", "function": {"name": "g"}}}, "tool_choice"),
        (CHAT, {**HELLO, "tool_choice": "required"}, "tool_choice"),
        (CHAT, {**HELLO, "top_logprobs": 2}, "top_logprobs"),
        (CHAT, {**HELLO, "response_format": {"type": "json_schema"}}, "response_format.json_schema"),
        (CHAT, {**HELLO, "messages": [{"role": "tool", "content": "x"}]}, "messages[0].tool_call_id"),
        ("/v1/completions", {"model": "tiny-llama", "prompt": "x", "suffix": "y"}, "suffix"),
        ("/v1/completions", {"model": "tiny-llama", "prompt": "x", "best_of": 2}, "best_of"),
        ("/v1/completions", {"model": "tiny-llama", "prompt": [1, 2], "echo": True}, "echo"),
        ("/v1/completions", {"model": "tiny-llama", "prompt": ["a"] * 9, "n": 2}, "n"),
    ],
)
def test_unsupported_values_are_400_naming_the_field(tiny_server: str, path: str, body: dict[str, Any],
                                                    param: str) -> None:
    error = assert_openai_error(httpx.post(tiny_server + path, json=body), 400)
    assert error["param"] == param, error


@pytest.mark.parametrize(
    ("path", "body"),
    [
        (CHAT, HELLO),
        ("/v1/completions", {"model": "tiny-llama", "prompt": "x", "max_tokens": 2}),
        ("/v1/embeddings", {"model": "tiny-llama", "input": "x"}),
        ("/v1/responses", {"model": "tiny-llama", "input": "x", "max_output_tokens": 2}),
    ],
)
def test_a_field_the_api_does_not_know_is_400_naming_it(tiny_server: str, path: str, body: dict[str, Any]) -> None:
    error = assert_openai_error(httpx.post(tiny_server + path, json={**body, "tempreature": 0}), 400,
                                "unknown_parameter")
    assert error["param"] == "tempreature" and "tempreature" in error["message"]


def test_unknown_fields_through_the_clients(tiny_server: str) -> None:
    client = openai.OpenAI(base_url=f"{tiny_server}/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.BadRequestError, match="bogus"):
        client.chat.completions.create(model="tiny-llama", messages=[{"role": "user", "content": "x"}],
                                       max_tokens=2, extra_body={"bogus": 1})
    answer = httpx.post(tiny_server + "/v1/messages", json={"model": "tiny-llama", "max_tokens": 2, "bogus": 1,
                                                            "messages": [{"role": "user", "content": "x"}]})
    assert answer.status_code == 400 and answer.json()["type"] == "error", answer.text
    assert "bogus" in answer.json()["error"]["message"]


def test_messages_echoed_from_a_response_keep_their_extra_keys(tiny_server: str) -> None:
    """Clients append the message a response gave them, with keys like ``refusal``: that is no unknown field."""
    client = openai.OpenAI(base_url=f"{tiny_server}/v1", api_key="x", max_retries=0)
    first = client.chat.completions.create(model="tiny-llama", messages=[{"role": "user", "content": "x"}],
                                           max_tokens=2, prompt_cache_key="conv-1", safety_identifier="u1")
    echoed = first.choices[0].message.model_dump() | {"annotations": [], "audio": None}
    again = client.chat.completions.create(model="tiny-llama", max_tokens=2, service_tier="auto", messages=[
        {"role": "user", "content": "x"}, echoed, {"role": "user", "content": "y"}])
    assert again.choices[0].finish_reason in ("stop", "length")
    for extra, param in (({"service_tier": "flex"}, "service_tier"), ({"metadata": {"k": "v"}}, "metadata"),
                         ({"verbosity": "low"}, "verbosity")):
        error = assert_openai_error(httpx.post(tiny_server + CHAT, json={**HELLO, **extra}), 400)
        assert error["param"] == param, error


def test_prompt_over_the_context_is_400(tiny_server: str) -> None:
    body = {**HELLO, "messages": [{"role": "user", "content": "x" * 600}]}
    assert_openai_error(httpx.post(tiny_server + CHAT, json=body), 400, "context_length_exceeded")


def test_body_over_the_limit_is_413(tiny_server: str) -> None:
    big = {**HELLO, "messages": [{"role": "user", "content": "x" * 300_000}]}
    assert_openai_error(httpx.post(tiny_server + CHAT, json=big), 413, "request_too_large")

    def chunks() -> Iterator[bytes]:  # no content-length: the limit counts bytes as they arrive
        yield b'{"model": "tiny-llama", "messages": [{"role": "user", "content": "'
        for _ in range(40):
            yield b"y" * 8192
        yield b'"}]}'

    response = httpx.post(tiny_server + CHAT, content=chunks(), headers={"content-type": "application/json"})
    assert_openai_error(response, 413, "request_too_large")


def test_unknown_route_and_method_are_openai_shaped(tiny_server: str) -> None:
    assert_openai_error(httpx.get(tiny_server + "/v1/nothing"), 404)
    assert_openai_error(httpx.get(tiny_server + CHAT), 405)


def test_health(tiny_server: str) -> None:
    assert httpx.get(tiny_server + "/health").json() == {"status": "ok", "models": 1, "active_requests": 0,
                                                         "ready_models": ["tiny-llama"], "loading": []}


class GatedBackend:
    """A backend whose generations wait until released: holds admission slots on demand."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.started = threading.Event()

    def models(self) -> list[ModelEntry]:
        return [ModelEntry(id="gated", nodes=("n1",))]

    async def generate(self, request: GenerationRequest) -> AsyncIterator[GenerationEvent]:
        self.started.set()
        while not self.release.is_set():
            await asyncio.sleep(0.01)
        yield TextDelta("ok")
        yield Finish(reason="stop", usage=Usage(1, 1))


def test_concurrency_limit_gives_429_with_retry_after_after_the_queue_deadline() -> None:
    backend = GatedBackend()
    app = create_app(backend, ApiLimits(max_concurrent=1, queue_timeout_s=0.2))
    body = {"model": "gated", "prompt": "x"}
    with serve(app) as url:
        results: list[httpx.Response] = []
        holder = threading.Thread(target=lambda: results.append(httpx.post(url + "/v1/completions", json=body)))
        holder.start()
        assert backend.started.wait(5)
        started = time.monotonic()
        refused = httpx.post(url + "/v1/completions", json=body)
        assert 0.15 < time.monotonic() - started < 3
        assert_openai_error(refused, 429, "rate_limit_exceeded")
        assert int(refused.headers["retry-after"]) >= 1
        backend.release.set()
        holder.join(10)
        assert results[0].status_code == 200 and results[0].json()["choices"][0]["text"] == "ok"
        assert httpx.get(url + "/health").json()["active_requests"] == 0


@pytest.fixture
def slow_engine(tiny_engine: LlamaEngine, monkeypatch: pytest.MonkeyPatch) -> LlamaEngine:
    """The tiny engine, its steps slowed to ~200 tokens/s so a disconnect lands mid-generation."""
    original = tiny_engine._run

    def slow_run(step: Any) -> None:
        time.sleep(0.005)
        original(step)

    monkeypatch.setattr(tiny_engine, "_run", slow_run)
    return tiny_engine


@pytest.mark.parametrize(("stream", "n"), [(True, 1), (False, 1), (False, 2)])
def test_client_disconnect_cancels_generation(slow_engine: LlamaEngine, stream: bool, n: int) -> None:
    """Every choice stops, even one still queued behind the other (this engine runs one request at a time)."""
    app = create_app(LocalBackend([slow_engine]))
    before = slow_engine.stats.cancelled, slow_engine.stats.completion_tokens
    body = {"model": "tiny-llama", "prompt": "go", "max_tokens": 400, "temperature": 0, "stream": stream, "n": n}
    with serve(app) as url:
        if stream:
            with httpx.stream("POST", url + "/v1/completions", json=body) as response:
                lines = response.iter_lines()
                assert next(lines).startswith("data: ")
        else:
            with pytest.raises(httpx.ReadTimeout):
                httpx.post(url + "/v1/completions", json=body, timeout=0.3)
        wait_until(lambda: slow_engine.stats.cancelled == before[0] + n, 10.0, interval=0.01)
    generated = slow_engine.stats.completion_tokens - before[1]
    assert generated < 300 * n  # every choice stopped long before max_tokens
    assert slow_engine.load_report().running == 0


def test_extra_routers_are_served_with_openai_shaped_errors() -> None:
    extra = APIRouter(dependencies=[Depends(require_api_key)])

    @extra.get("/api/ping")
    async def ping() -> dict[str, str]:
        return {"pong": "yes"}

    @extra.get("/api/busy")
    async def busy() -> dict[str, str]:
        raise NoCapacity("busy")

    with serve(create_app(GatedBackend(), routers=[extra])) as url:
        assert httpx.get(url + "/api/ping").json() == {"pong": "yes"}
        refused = httpx.get(url + "/api/busy")
        assert_openai_error(refused, 503, "no_capacity")
        assert refused.headers["retry-after"] == "1"  # every 503 tells the client when to come back



def test_values_a_peer_could_not_receive_are_refused_at_the_edge(tiny_server: str) -> None:
    """A routed request must never fail while being encoded (and charge healthy peers with the failure)."""
    huge = httpx.post(tiny_server + CHAT, json={**HELLO, "max_tokens": 10**30})
    assert assert_openai_error(huge, 422, "invalid_value")["param"] == "max_tokens"
    tools = httpx.post(tiny_server + CHAT, json={**HELLO, "tools": [{"type": "function", "function": {
        "name": "f", "parameters": {"type": "integer", "maximum": 10**30}}}]})
    assert "tools" in assert_openai_error(tools, 422, "invalid_value")["message"]
