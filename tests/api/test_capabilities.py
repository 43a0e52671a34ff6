"""A field the serving engine cannot honour is a 400 naming it, never silently ignored."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from api_server import serve

from meshllm.api.app import LocalBackend, create_app
from meshllm.engine.ggml.engine import GgmlEngine
from meshllm.engine.llama import LlamaEngine

CHAT = {"model": "plain", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}


@pytest.fixture(scope="module")
def url(tiny_gguf: Path) -> Iterator[str]:
    """A llama.cpp engine that declares no optional features, and a ggml engine (which cannot embed)."""
    plain = LlamaEngine(tiny_gguf, model_id="plain", n_ctx=256, n_threads=1)
    plain.supports = frozenset()
    numpy = GgmlEngine(tiny_gguf, model_id="numpy")
    for engine in (plain, numpy):
        asyncio.run(engine.load())
    with serve(create_app(LocalBackend([plain, numpy]))) as base:
        yield base
    for engine in (plain, numpy):
        asyncio.run(engine.close())


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/v1/chat/completions", {**CHAT, "response_format": {"type": "json_object"}}, "response_format"),
    ("/v1/chat/completions", {**CHAT, "tools": [WEATHER], "tool_choice": "required"}, "response_format"),
    ("/v1/chat/completions", {**CHAT, "logprobs": True}, "logprobs"),
    ("/v1/completions", {"model": "plain", "prompt": "ab", "logprobs": 1}, "logprobs"),
    ("/v1/completions", {"model": "plain", "prompt": [1, 2, 3]}, "prompt"),
    ("/v1/responses", {"model": "plain", "input": "hi", "text": {"format": {"type": "json_object"}}},
     "response_format"),
    ("/v1/embeddings", {"model": "numpy", "input": "hi"}, "model"),
])
def test_unsupported_features_are_400_naming_the_field(url: str, path: str, body: dict[str, Any], param: str) -> None:
    response = httpx.post(url + path, json=body, timeout=30)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["code"] == "unsupported_parameter" and error["param"] == param
    assert "Traceback" not in error["message"]


def test_the_same_engine_serves_what_it_can(url: str) -> None:
    response = httpx.post(url + "/v1/chat/completions", json={**CHAT, "temperature": 0}, timeout=30)
    assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 2
    assert httpx.post(url + "/v1/embeddings", json={"model": "plain", "input": "hi"}, timeout=30).status_code == 200
