"""LlamaEngine on a tiny random llama model: counts, determinism, stops, limits, cancellation."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import pytest
from tinymodels import write_tiny_llama

from meshllm.engine.base import (
    ChatMessage,
    ChatRequest,
    CompletionRequest,
    EngineBusy,
    Finish,
    GenerationEvent,
    GenerationParams,
    PromptTooLong,
    TextDelta,
)
from meshllm.engine.llama import LlamaEngine
from meshllm.engine.text import StopMatcher


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LlamaEngine]:
    path = write_tiny_llama(tmp_path_factory.mktemp("m") / "tiny.gguf", seed=1)
    eng = LlamaEngine(path, n_ctx=256, n_threads=1, max_queue=2)
    asyncio.run(eng.load())
    yield eng
    asyncio.run(eng.close())


def run(engine: LlamaEngine, request: ChatRequest | CompletionRequest) -> list[GenerationEvent]:
    async def collect() -> list[GenerationEvent]:
        return [event async for event in engine.generate(request)]

    return asyncio.run(collect())


def idle(engine: LlamaEngine, timeout_s: float = 2.0) -> bool:
    """Wait for the worker to finish its bookkeeping (it runs just after the last event)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        report = engine.load_report()
        if report.running == report.queued == 0:
            return True
        time.sleep(0.01)
    return False


def completion(prompt: str = "hello", **params: object) -> CompletionRequest:
    return CompletionRequest(model="tiny", prompt=prompt, params=GenerationParams(**params))  # type: ignore[arg-type]


def test_usage_counts_prompt_and_generated_tokens(engine: LlamaEngine) -> None:
    request = completion("hello", max_tokens=7, seed=1)
    events = run(engine, request)
    finish = events[-1]
    assert isinstance(finish, Finish) and finish.reason == "length"
    # byte vocabulary: BOS, llama.cpp's space prefix ("\u2581", 3 bytes), then one token per byte
    assert finish.usage.prompt_tokens == len(engine.prompt_tokens(request)) == 1 + 3 + len(b"hello")
    assert finish.usage.completion_tokens == 7
    assert all(isinstance(e, TextDelta) for e in events[:-1])


def test_same_seed_same_text_and_temperature_zero_is_greedy(engine: LlamaEngine) -> None:
    def text(**params: object) -> str:
        return "".join(e.text for e in run(engine, completion("abc", max_tokens=24, **params))
                       if isinstance(e, TextDelta))

    assert text(seed=42, temperature=1.0) == text(seed=42, temperature=1.0)
    assert text(temperature=0.0) == text(temperature=0.0)


def test_chat_uses_fallback_format_for_template_less_llama(engine: LlamaEngine) -> None:
    assert engine.chat_format == "llama-2"
    request = ChatRequest(model="tiny", messages=(ChatMessage("system", "be brief"), ChatMessage("user", "hi")),
                          params=GenerationParams(max_tokens=5, seed=3))
    finish = run(engine, request)[-1]
    assert isinstance(finish, Finish)
    assert finish.usage.prompt_tokens == len(engine.prompt_tokens(request)) > len(b"be brief hi")


def test_stop_string_cuts_text_before_it(engine: LlamaEngine) -> None:
    full = "".join(e.text for e in run(engine, completion("xyz", max_tokens=40, temperature=0.0))
                   if isinstance(e, TextDelta))
    stop = full[5:7]
    assert stop and stop not in full[:5]
    events = run(engine, completion("xyz", max_tokens=40, temperature=0.0, stop=(stop,)))
    text = "".join(e.text for e in events if isinstance(e, TextDelta))
    assert text == full[: full.index(stop)]
    assert isinstance(events[-1], Finish) and events[-1].reason == "stop"


def test_max_tokens_is_clamped_to_the_context(engine: LlamaEngine) -> None:
    finish = run(engine, completion("a" * 200, max_tokens=10_000, temperature=0.0))[-1]
    assert isinstance(finish, Finish) and finish.reason in ("length", "stop")
    assert finish.usage.prompt_tokens + finish.usage.completion_tokens <= engine.context_length


def test_prompt_longer_than_context_is_refused(engine: LlamaEngine) -> None:
    with pytest.raises(PromptTooLong):
        run(engine, completion("a" * 300))


def test_closing_the_stream_cancels_between_tokens(engine: LlamaEngine) -> None:
    before = engine.stats.cancelled, engine.stats.completion_tokens

    async def read_two() -> None:
        stream = engine.generate(completion("go", max_tokens=200, temperature=0.0))
        await anext(stream)
        await anext(stream)
        await stream.aclose()  # type: ignore[attr-defined]
        for _ in range(200):  # the worker notices at the next token
            if engine.stats.cancelled > before[0]:
                return
            await asyncio.sleep(0.01)

    asyncio.run(read_two())
    assert engine.stats.cancelled == before[0] + 1
    assert engine.stats.completion_tokens - before[1] < 200
    assert idle(engine)


def test_full_queue_is_refused_with_engine_busy(engine: LlamaEngine) -> None:
    async def flood() -> list[BaseException | None]:
        async def one() -> BaseException | None:
            try:
                async for _ in engine.generate(completion("q", max_tokens=20)):
                    pass
            except EngineBusy as exc:
                return exc
            return None

        return await asyncio.gather(*(one() for _ in range(8)))

    outcomes = asyncio.run(flood())
    assert any(isinstance(o, EngineBusy) for o in outcomes)
    assert any(o is None for o in outcomes)
    assert idle(engine) and engine.load_report().max_queue == 2


@pytest.mark.parametrize(
    ("pieces", "stops", "expected", "hit"),
    [
        (["Hel", "lo wor", "ld"], ["wor"], "Hello ", True),
        (["ab", "c"], ["bd"], "abc", False),  # held "b" is released once "c" rules the stop out
        (["x<", "/s", ">y"], ["</s>"], "x", True),
        (["abc"], [], "abc", False),
    ],
)
def test_stop_matcher_never_leaks_a_partial_stop(pieces: list[str], stops: list[str], expected: str, hit: bool) -> None:
    matcher = StopMatcher(stops)
    out = ""
    for piece in pieces:
        text, found = matcher.feed(piece)
        out += text
        if found:
            break
    if not matcher.hit:
        out += matcher.flush()
    assert (out, matcher.hit) == (expected, hit)
