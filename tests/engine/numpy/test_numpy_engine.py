"""NumpyEngine behind the shared Engine interface, on the tiny llama model."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from stage_helpers import LLAMA_THREADS

from meshllm.engine.base import (
    ChatMessage,
    ChatRequest,
    CompletionRequest,
    EngineBusy,
    EngineNotLoaded,
    Finish,
    GenerationEvent,
    GenerationParams,
    GenerationRequest,
    PromptTooLong,
    TextDelta,
)
from meshllm.engine.numpy.engine import NumpyEngine


@pytest.fixture
def engine(tiny_llama: Path) -> Iterator[NumpyEngine]:
    eng = NumpyEngine(tiny_llama, n_ctx=128)
    asyncio.run(eng.load())
    yield eng
    asyncio.run(eng.close())


async def _collect(events: AsyncIterator[GenerationEvent]) -> tuple[str, Finish]:
    text = []
    async for event in events:
        if isinstance(event, TextDelta):
            text.append(event.text)
        else:
            return "".join(text), event
    raise AssertionError("no Finish event")


def _run(engine: NumpyEngine, request: GenerationRequest) -> tuple[str, Finish]:
    return asyncio.run(_collect(engine.generate(request)))


def _completion(prompt: str = "Hello", **params: object) -> CompletionRequest:
    return CompletionRequest(model="tiny", prompt=prompt, params=GenerationParams(**params))  # type: ignore[arg-type]


def test_greedy_completion_matches_llama_cpp(engine: NumpyEngine, tiny_llama: Path) -> None:
    from llama_cpp import Llama

    llm = Llama(model_path=str(tiny_llama), n_ctx=128, n_threads=LLAMA_THREADS, verbose=False)
    try:
        prompt = llm.tokenize(b"Hello", add_bos=True)
        expected = []
        for token in llm.generate(prompt, temp=0.0, top_k=1, reset=True):
            expected.append(token)
            if len(expected) == 12:
                break
        expected_text = llm.detokenize(expected).decode("utf-8", errors="replace")
    finally:
        llm.close()
    text, finish = _run(engine, _completion(max_tokens=12, temperature=0.0))
    assert text == expected_text
    assert finish.reason == "length"
    assert (finish.usage.prompt_tokens, finish.usage.completion_tokens) == (len(prompt), 12)


def test_seed_reproduces(engine: NumpyEngine) -> None:
    a = _run(engine, _completion(max_tokens=10, temperature=1.0, seed=5))
    b = _run(engine, _completion(max_tokens=10, temperature=1.0, seed=5))
    c = _run(engine, _completion(max_tokens=10, temperature=1.0, seed=6))
    assert a == b and a[0] != c[0]


def test_stop_string_ends_generation_without_sending_it(engine: NumpyEngine) -> None:
    text, _ = _run(engine, _completion(max_tokens=12, temperature=0.0))
    stop = text[4:6]
    cut, finish = _run(engine, _completion(max_tokens=12, temperature=0.0, stop=(stop,)))
    assert finish.reason == "stop" and cut == text[: text.index(stop)]


def test_chat_request_renders_a_prompt(engine: NumpyEngine) -> None:
    request = ChatRequest(model="tiny", messages=(ChatMessage("user", "hi"),), params=GenerationParams(max_tokens=3))
    tokens, _ = engine.prompt_tokens(request)
    assert len(tokens) > 3
    _, finish = _run(engine, request)
    assert finish.usage.prompt_tokens == len(tokens)


def test_prompt_too_long(engine: NumpyEngine) -> None:
    with pytest.raises(PromptTooLong):
        _run(engine, _completion("x" * 200))


def test_cancel_by_closing_the_stream_frees_the_engine(engine: NumpyEngine) -> None:
    async def scenario() -> tuple[str, Finish]:
        stream = engine.generate(_completion(max_tokens=50, temperature=0.0))
        async for event in stream:
            assert isinstance(event, TextDelta)
            break
        await stream.aclose()
        assert engine.load_report().running == 0
        return await _collect(engine.generate(_completion(max_tokens=2)))

    _, finish = asyncio.run(scenario())
    assert finish.usage.completion_tokens == 2
    assert engine.stage is not None and not engine.stage._sessions  # the cancelled session was dropped


def test_queue_limit(tiny_llama: Path) -> None:
    async def scenario() -> None:
        eng = NumpyEngine(tiny_llama, n_ctx=64, max_queue=0)
        await eng.load()
        with pytest.raises(EngineBusy):
            await _collect(eng.generate(_completion()))
        await eng.close()
        with pytest.raises(EngineNotLoaded):
            await _collect(eng.generate(_completion()))

    asyncio.run(scenario())
