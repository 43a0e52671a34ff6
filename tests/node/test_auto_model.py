"""The ``auto`` model on two real nodes: requests land on the model the rules say, and move under load.

alpha serves ``short`` (512-token context, no tool template, one slot); beta serves ``tiny-tools``
(4,096 tokens as served, a template that renders tools). Every request goes to alpha's API as ``model="auto"``.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from nodes import NodeProcess, running_nodes, wait_until
from tinymodels import TOOL_MODEL, write_tiny_llama, write_tiny_tool_model

pytestmark = pytest.mark.timeout(180)

SHORT = "short"
CITY = {"type": "object", "properties": {"city": {"type": "string"}}}
WEATHER = {"type": "function",
           "function": {"name": "get_weather", "description": "Weather of a city", "parameters": CITY}}


@pytest.fixture(scope="module")
def mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[NodeProcess, NodeProcess]]:
    tmp = tmp_path_factory.mktemp("auto")
    # slow enough (width 384, 6 layers) that a few long streams keep its one slot busy for seconds
    write_tiny_llama(tmp / f"{SHORT}.gguf", seed=3, n_layers=6, width=384, heads=8, ffn=1536, context=512)
    write_tiny_tool_model(tmp / f"{TOOL_MODEL}.gguf")
    with running_nodes() as nodes:
        alpha = NodeProcess(tmp / "alpha", ["--model", str(tmp / f"{SHORT}.gguf"), "--parallel", "1"], "alpha")
        nodes.append(alpha)
        token = alpha.wait_ready()["invite"]
        beta = NodeProcess(tmp / "beta", ["--model", str(tmp / f"{TOOL_MODEL}.gguf"), "--join", token], "beta")
        nodes.append(beta)
        beta.wait_ready()
        wait_until(lambda: {m["id"] for m in models(alpha)} == {SHORT, TOOL_MODEL, "auto"}, 20.0)
        yield alpha, beta


def models(node: NodeProcess) -> list[dict[str, Any]]:
    return httpx.get(f"{node.api}/v1/models", timeout=5).json()["data"]


def ask(node: NodeProcess, content: str, **extra: Any) -> tuple[str, str]:
    """``model`` of the answer to an ``auto`` request, and its routed-model header."""
    raw = openai.OpenAI(base_url=f"{node.api}/v1", api_key="x", max_retries=0, timeout=60) \
        .chat.completions.with_raw_response.create(model="auto", messages=[{"role": "user", "content": content}],
                                                   max_tokens=4, temperature=0, **extra)
    return raw.parse().model, raw.headers["x-meshllm-routed-model"]


def test_auto_is_listed_with_the_longest_context(mesh: tuple[NodeProcess, NodeProcess]) -> None:
    listed = {m["id"]: m for m in models(mesh[0])}
    assert listed[SHORT]["context_length"] == 512 and listed[TOOL_MODEL]["context_length"] == 4096
    assert listed["auto"]["context_length"] == 4096 and listed["auto"]["nodes"] == []


def test_tools_long_prompts_and_plain_requests_land_where_the_rules_say(mesh: tuple[NodeProcess, NodeProcess]) -> None:
    alpha = mesh[0]
    assert ask(alpha, "What is the weather in Paris?", tools=[WEATHER]) == (TOOL_MODEL, TOOL_MODEL)
    # ~1,800 characters: more than 512 tokens at 3 characters a token (the estimate), under 4,096
    assert ask(alpha, "Summarise this: " + "lorem ipsum dolor " * 100) == (TOOL_MODEL, TOOL_MODEL)
    assert ask(alpha, "Hello there") == (SHORT, SHORT)  # the smallest context that holds it
    reasons = [e for e in alpha.events if e["type"] == "auto_routed"]
    assert [e["model"] for e in reasons[-3:]] == [TOOL_MODEL, TOOL_MODEL, SHORT]
    assert "tools" in reasons[-3]["reason"] and "context" in reasons[-2]["reason"] and "size" in reasons[-1]["reason"]


def test_with_shorts_only_slot_busy_plain_requests_shift_to_the_other_model(
        mesh: tuple[NodeProcess, NodeProcess]) -> None:
    alpha = mesh[0]
    client = openai.OpenAI(base_url=f"{alpha.api}/v1", api_key="x", max_retries=0, timeout=120)
    started = threading.Event()

    def long_stream() -> None:
        stream = client.completions.create(model=SHORT, prompt="a", max_tokens=500, temperature=0, stream=True)
        for _ in stream:
            started.set()

    # one stream runs in short's only slot and two wait behind it
    workers = [threading.Thread(target=long_stream, daemon=True) for _ in range(3)]
    for worker in workers:
        worker.start()
    assert started.wait(30)
    shifted = ask(alpha, "Hello there")
    finished = [w for w in workers if not w.is_alive()]
    assert len(finished) < len(workers), "every long stream ended before the request was routed: slow the model"
    assert shifted == (TOOL_MODEL, TOOL_MODEL)
    assert "load: a free slot" in [e for e in alpha.events if e["type"] == "auto_routed"][-1]["reason"]
    for worker in workers:
        worker.join(120)
    assert ask(alpha, "Hello there") == (SHORT, SHORT)  # free again: back to the small model
