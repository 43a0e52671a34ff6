"""The README's main command, and the ggml engine end to end, as real ``meshllm serve`` processes.

``./install.sh && meshllm serve`` then the README's chat through the ``openai`` package must get an
answer from the bundled default model (SmolLM2-135M-Instruct): a greeting for "Hi", and a working
Python function for a coding request, each ending by itself (finish ``stop``). ``meshllm serve
--engine ggml`` must answer through the same API, with the same greedy text as llama.cpp on the
same GGUF.
"""

from __future__ import annotations

import re
from pathlib import Path

import openai
import pytest
from nodes import NodeProcess, running_nodes
from tinymodels import write_tiny_llama

pytestmark = pytest.mark.timeout(120)

DEFAULT_MODEL = "SmolLM2-135M-Instruct.Q4_1"


def client_of(node: NodeProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{node.api}/v1", api_key="unused", max_retries=0, timeout=60)


def chat_text(node: NodeProcess, model: str, max_tokens: int) -> str:
    reply = client_of(node).chat.completions.create(
        model=model, max_tokens=max_tokens, temperature=0,
        messages=[{"role": "user", "content": "What is the capital of France?"}])
    assert reply.usage is not None and 0 < reply.usage.completion_tokens <= max_tokens
    return reply.choices[0].message.content or ""


@pytest.mark.slow
def test_meshllm_serve_with_no_model_chats_with_the_default_model(tmp_path: Path) -> None:
    with running_nodes() as nodes:
        node = NodeProcess(tmp_path / "n", [], "n")  # exactly `meshllm serve` (plus free ports)
        nodes.append(node)
        node.wait_ready()
        kinds = [e["type"] for e in node.events]
        assert kinds.index("model_loading") < kinds.index("model_ready") < kinds.index("ready")
        ready = next(e for e in node.events if e["type"] == "model_ready")
        assert ready["model"] == DEFAULT_MODEL and ready["engine"] == "llama" and ready["context"] > 0
        client = client_of(node)
        assert [m.id for m in client.models.list().data] == [DEFAULT_MODEL, "auto"]  # README takes data[0]

        hi = client.chat.completions.create(model=DEFAULT_MODEL, temperature=0,
                                            messages=[{"role": "user", "content": "Hi"}])
        assert hi.choices[0].finish_reason == "stop"
        assert re.match(r"\W*(hello|hi)\b", (hi.choices[0].message.content or "").lower())

        code = client.chat.completions.create(
            model=DEFAULT_MODEL, temperature=0,
            messages=[{"role": "user", "content": "Write a Python function that reverses a string."}])
        assert code.choices[0].finish_reason == "stop"
        block = re.search(r"```(?:python)?\n(.*?)```", code.choices[0].message.content or "", re.S)
        assert block, code.choices[0].message.content
        scope: dict[str, object] = {}
        exec(block.group(1), scope)  # the model's own code, run as a user would paste it
        functions = [f for name, f in scope.items() if callable(f) and not name.startswith("__")]
        assert functions and all(f("meshllm") == "mllhsem" for f in functions)


@pytest.mark.slow
def test_ggml_engine_serves_the_default_model_with_llama_cpps_text(tmp_path: Path) -> None:
    with running_nodes() as nodes:
        llama = NodeProcess(tmp_path / "llama", ["--threads", "1"], "llama")
        node = NodeProcess(tmp_path / "n", ["--engine", "ggml", "--threads", "1"], "n")
        nodes += [llama, node]
        node.wait_ready(timeout=90)
        llama.wait_ready(timeout=90)
        assert next(e for e in node.events if e["type"] == "model_ready")["engine"] == "ggml"
        text = chat_text(node, DEFAULT_MODEL, 24)
        assert text.strip() and text == chat_text(llama, DEFAULT_MODEL, 24)


def test_ggml_and_llama_engines_give_the_same_greedy_text_through_the_api(tmp_path: Path) -> None:
    gguf = write_tiny_llama(tmp_path / "tiny.gguf", seed=0)
    with running_nodes() as nodes:
        llama = NodeProcess(tmp_path / "llama", ["--model", str(gguf)], "llama")
        ggml = NodeProcess(tmp_path / "ggml", ["--model", str(gguf), "--engine", "ggml"], "ggml")
        nodes += [llama, ggml]
        for node in nodes:
            node.wait_ready()
        texts = []
        for node in nodes:
            reply = client_of(node).completions.create(model="tiny", prompt="Hello", max_tokens=24, temperature=0)
            assert reply.usage is not None and reply.usage.completion_tokens == 24
            texts.append(reply.choices[0].text)
        assert texts[0] == texts[1]
