"""GgmlEngine behind the shared Engine interface, on the tiny llama model."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from stage_helpers import llama_cpp

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
    Unsupported,
)
from meshllm.engine.ggml.engine import GgmlEngine


@pytest.fixture
def engine(tiny_llama: Path) -> Iterator[GgmlEngine]:
    eng = GgmlEngine(tiny_llama, n_ctx=128, threads=1)
    asyncio.run(eng.load())
    yield eng
    asyncio.run(eng.close())


async def _events(events: AsyncIterator[GenerationEvent]) -> list[GenerationEvent]:
    return [event async for event in events]


def _run_events(engine: GgmlEngine, request: GenerationRequest) -> list[GenerationEvent]:
    return asyncio.run(_events(engine.generate(request)))


def _run(engine: GgmlEngine, request: GenerationRequest) -> tuple[str, Finish]:
    events = _run_events(engine, request)
    finish = events[-1]
    assert isinstance(finish, Finish)
    return "".join(e.text for e in events if isinstance(e, TextDelta)), finish


def _completion(prompt: str | tuple[int, ...] = "Hello", continuation: tuple[int, ...] = (),
                **params: object) -> CompletionRequest:
    return CompletionRequest(model="tiny", prompt=prompt, params=GenerationParams(**params),  # type: ignore[arg-type]
                             continuation=continuation)


def test_greedy_completion_matches_llama_cpp(engine: GgmlEngine, tiny_llama: Path) -> None:
    llm = llama_cpp(tiny_llama, n_ctx=128)
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


def test_deltas_carry_their_token_ids(engine: GgmlEngine) -> None:
    events = _run_events(engine, _completion(max_tokens=12, temperature=0.0))
    deltas = [e for e in events if isinstance(e, TextDelta)]
    tokens = [t for d in deltas for t in d.tokens]
    assert len(tokens) == 12 and all(d.tokens for d in deltas)
    assert engine.tokenizer is not None and engine.tokenizer.decode(tokens) == "".join(d.text for d in deltas)


def test_token_id_prompt_is_the_same_as_its_text(engine: GgmlEngine) -> None:
    assert engine.tokenizer is not None
    ids = tuple(engine.tokenizer.encode("Hello"))
    assert _run(engine, _completion(ids, max_tokens=8, temperature=0.0)) == \
        _run(engine, _completion("Hello", max_tokens=8, temperature=0.0))
    with pytest.raises(Unsupported, match="outside the vocabulary") as info:
        _run(engine, _completion((1, 5000), max_tokens=2))
    assert info.value.param == "prompt"


def test_continuation_resumes_where_another_engine_stopped(engine: GgmlEngine) -> None:
    """Replay the first 5 generated tokens: the stream continues with exactly the other 7."""
    events = _run_events(engine, _completion(max_tokens=12, temperature=0.0))
    tokens = tuple(t for e in events if isinstance(e, TextDelta) for t in e.tokens)
    rest = _run_events(engine, _completion(max_tokens=12, temperature=0.0, continuation=tokens[:5]))
    assert tuple(t for e in rest if isinstance(e, TextDelta) for t in e.tokens) == tokens[5:]
    assert engine.replay_rows == 4  # one-row steps as they were computed (the 5th is the step that samples)
    finish = rest[-1]
    assert isinstance(finish, Finish) and finish.usage.completion_tokens == 12 and finish.reason == "length"
    text = "".join(e.text for e in events if isinstance(e, TextDelta))
    assert text.endswith("".join(e.text for e in rest if isinstance(e, TextDelta)))


def test_a_seeded_continuation_resumes_its_random_stream(engine: GgmlEngine) -> None:
    events = _run_events(engine, _completion(max_tokens=12, temperature=0.9, seed=11))
    tokens = tuple(t for e in events if isinstance(e, TextDelta) for t in e.tokens)
    rest = _run_events(engine, _completion(max_tokens=12, temperature=0.9, seed=11, continuation=tokens[:7]))
    assert tuple(t for e in rest if isinstance(e, TextDelta) for t in e.tokens) == tokens[7:]


def test_a_continuation_computed_otherwise_is_logged_and_continued(engine: GgmlEngine,
                                                                   caplog: pytest.LogCaptureFixture) -> None:
    """Tokens this engine would not have produced (another engine's, other kernels) are still the text sent:
    the replay says where they part and goes on after them."""
    events = _run_events(engine, _completion(max_tokens=12, temperature=0.0))
    tokens = [t for e in events if isinstance(e, TextDelta) for t in e.tokens]
    other = (tokens[0], tokens[1], 3 + (tokens[2] - 2) % 256, tokens[3])  # a byte token the model did not pick
    with caplog.at_level("WARNING", logger="meshllm.engine.ggml.engine"):
        rest = _run_events(engine, _completion(max_tokens=12, temperature=0.0, continuation=other))
    assert [r.getMessage() for r in caplog.records] == \
        [f"model {engine.model_id}: replayed token 2 ({other[2]}) is not what this engine computes there; "
         "the request began on another engine or kernels"]
    finish = rest[-1]
    assert isinstance(finish, Finish) and finish.usage.completion_tokens == 12


def test_past_its_bound_a_continuation_is_prefilled(tiny_llama: Path) -> None:
    eng = GgmlEngine(tiny_llama, n_ctx=128, threads=1, replay_steps_s=0.0)
    asyncio.run(eng.load())
    try:
        events = _run_events(eng, _completion(max_tokens=12, temperature=0.0))
        tokens = tuple(t for e in events if isinstance(e, TextDelta) for t in e.tokens)
        rest = _run_events(eng, _completion(max_tokens=12, temperature=0.0, continuation=tokens[:5]))
        assert eng.replay_rows == 0
        finish = rest[-1]
        assert isinstance(finish, Finish) and finish.usage.completion_tokens == 12
    finally:
        asyncio.run(eng.close())


def test_seed_reproduces(engine: GgmlEngine) -> None:
    a = _run(engine, _completion(max_tokens=10, temperature=1.0, seed=5))
    b = _run(engine, _completion(max_tokens=10, temperature=1.0, seed=5))
    c = _run(engine, _completion(max_tokens=10, temperature=1.0, seed=6))
    assert a == b and a[0] != c[0]


def test_stop_string_ends_generation_without_sending_it(engine: GgmlEngine) -> None:
    text, _ = _run(engine, _completion(max_tokens=12, temperature=0.0))
    stop = text[4:6]
    cut, finish = _run(engine, _completion(max_tokens=12, temperature=0.0, stop=(stop,)))
    assert finish.reason == "stop" and cut == text[: text.index(stop)]


def test_chat_request_renders_a_prompt(engine: GgmlEngine) -> None:
    request = ChatRequest(model="tiny", messages=(ChatMessage("user", "hi"),), params=GenerationParams(max_tokens=3))
    tokens, _ = engine.prompt_tokens(request)
    assert len(tokens) > 3
    _, finish = _run(engine, request)
    assert finish.usage.prompt_tokens == len(tokens)


def test_prompt_too_long(engine: GgmlEngine) -> None:
    with pytest.raises(PromptTooLong):
        _run(engine, _completion("x" * 200))


def test_cancel_by_closing_the_stream_frees_the_engine(engine: GgmlEngine) -> None:
    async def scenario() -> tuple[str, Finish]:
        stream = engine.generate(_completion(max_tokens=50, temperature=0.0))
        async for event in stream:
            assert isinstance(event, TextDelta)
            break
        await stream.aclose()
        assert engine.load_report().running == 0
        events = await _events(engine.generate(_completion(max_tokens=2, temperature=0.0)))
        assert isinstance(events[-1], Finish)
        return "", events[-1]

    _, finish = asyncio.run(scenario())
    assert finish.usage.completion_tokens == 2
    assert engine.stage is not None and engine.stage.memory()["kv"] == 0  # the cancelled session was freed


def test_queue_limit_and_close(tiny_llama: Path) -> None:
    async def scenario() -> None:
        eng = GgmlEngine(tiny_llama, n_ctx=64, max_queue=0, threads=1)
        await eng.load()
        with pytest.raises(EngineBusy):
            await _events(eng.generate(_completion()))
        await eng.close()
        with pytest.raises(EngineNotLoaded):
            await _events(eng.generate(_completion()))

    asyncio.run(scenario())
