"""The real ``openai`` client against the app on uvicorn, serving a tiny llama model."""

from __future__ import annotations

import openai
import pytest

from meshllm.engine.base import ChatMessage, ChatRequest, CompletionRequest
from meshllm.engine.llama import LlamaEngine

MODEL = "tiny-llama"
MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Say hi"}]


@pytest.fixture(scope="module")
def client(tiny_server: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{tiny_server}/v1", api_key="unused", max_retries=0, timeout=30)


def chat_prompt_tokens(engine: LlamaEngine) -> int:
    messages = tuple(ChatMessage(m["role"], m["content"]) for m in MESSAGES)
    return len(engine.prompt_tokens(ChatRequest(model=MODEL, messages=messages)))


def test_model_list_names_the_model_and_its_node(client: openai.OpenAI) -> None:
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL, "auto"]
    assert models[0].owned_by == "meshllm"
    assert models[0].model_extra == {"nodes": ["node-a"], "node_names": ["node-a"], "context_length": 512}
    assert client.models.retrieve(MODEL).id == MODEL


def test_chat_non_streaming_reports_exact_usage(client: openai.OpenAI, tiny_engine: LlamaEngine) -> None:
    reply = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=12, seed=7)  # type: ignore[arg-type]
    choice = reply.choices[0]
    assert choice.message.role == "assistant" and choice.finish_reason == "length"
    assert reply.usage is not None
    assert reply.usage.prompt_tokens == chat_prompt_tokens(tiny_engine)
    assert reply.usage.completion_tokens == 12
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + 12


def test_chat_streaming_matches_non_streaming_for_the_same_seed(client: openai.OpenAI,
                                                                tiny_engine: LlamaEngine) -> None:
    whole = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=10, seed=3)  # type: ignore[arg-type]
    chunks = list(client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=10, seed=3,  # type: ignore[arg-type]
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    usage = chunks[-1].usage
    assert not chunks[-1].choices and usage is not None
    assert (usage.prompt_tokens, usage.completion_tokens) == (chat_prompt_tokens(tiny_engine), 10)


def test_completion_non_streaming_and_streaming(client: openai.OpenAI, tiny_engine: LlamaEngine) -> None:
    whole = client.completions.create(model=MODEL, prompt="Once upon", max_tokens=9, seed=11)
    assert whole.choices[0].finish_reason == "length"
    assert whole.usage is not None and whole.usage.completion_tokens == 9
    expected = len(tiny_engine.prompt_tokens(CompletionRequest(model=MODEL, prompt="Once upon")))
    assert whole.usage.prompt_tokens == expected
    chunks = list(client.completions.create(model=MODEL, prompt="Once upon", max_tokens=9, seed=11, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == whole.choices[0].text
    assert chunks[-1].choices[0].finish_reason == "length"


def test_same_seed_gives_same_text_twice(client: openai.OpenAI) -> None:
    def once(seed: int) -> str:
        reply = client.completions.create(model=MODEL, prompt="abc", max_tokens=20, seed=seed, temperature=1.0)
        return reply.choices[0].text

    assert once(5) == once(5)


def test_stop_sequence_ends_the_text_before_it(client: openai.OpenAI) -> None:
    free = client.completions.create(model=MODEL, prompt="xyz", max_tokens=30, temperature=0).choices[0].text
    stop = free[4:6]
    assert stop and stop not in free[:4]
    stopped = client.completions.create(model=MODEL, prompt="xyz", max_tokens=30, temperature=0, stop=[stop])
    assert stopped.choices[0].text == free[: free.index(stop)]
    assert stopped.choices[0].finish_reason == "stop"
    streamed = client.completions.create(model=MODEL, prompt="xyz", max_tokens=30, temperature=0, stop=stop,
                                         stream=True)
    assert "".join(c.choices[0].text for c in streamed) == free[: free.index(stop)]


def test_max_tokens_gives_finish_reason_length(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=1,  # type: ignore[arg-type]
                                            temperature=0)
    assert reply.choices[0].finish_reason == "length"
    assert reply.usage is not None and reply.usage.completion_tokens == 1


def test_echo_prepends_the_prompt(client: openai.OpenAI) -> None:
    reply = client.completions.create(model=MODEL, prompt="Echo me", max_tokens=3, echo=True)
    assert reply.choices[0].text.startswith("Echo me")
