"""LlamaEngine on a tiny random llama model: counts, stops, limits, grammar, logprobs, token ids, refusals."""

from __future__ import annotations

import asyncio
import re
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from net.net_helpers import until
from tinymodels import write_tiny_llama

from meshllm.engine.base import (
    REPLAY_STEPS_S,
    ChatMessage,
    ChatRequest,
    CompletionRequest,
    EngineBusy,
    EngineError,
    EngineNotLoaded,
    Finish,
    GenerationEvent,
    GenerationParams,
    InvalidRequest,
    PromptTooLong,
    TextDelta,
)
from meshllm.engine.gbnf import BadGrammar
from meshllm.engine.llama import LlamaEngine
from meshllm.engine.text import StopMatcher


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_llama(tmp_path_factory.mktemp("m") / "tiny.gguf", seed=1)


@pytest.fixture(scope="module")
def engine(tiny: Path) -> Iterator[LlamaEngine]:
    eng = LlamaEngine(tiny, n_ctx=256, n_threads=1, parallel=4)
    asyncio.run(eng.load())
    yield eng
    asyncio.run(eng.close())


def run(engine: LlamaEngine, request: ChatRequest | CompletionRequest) -> list[GenerationEvent]:
    async def collect() -> list[GenerationEvent]:
        return [event async for event in engine.generate(request)]

    return asyncio.run(collect())


def text_of(events: list[GenerationEvent]) -> str:
    return "".join(e.text for e in events if isinstance(e, TextDelta))


def tokens_of(events: list[GenerationEvent]) -> list[int]:
    return [t for e in events if isinstance(e, TextDelta) for t in e.tokens]


def idle(engine: LlamaEngine, timeout_s: float = 2.0) -> bool:
    """Wait for the worker to finish its bookkeeping (it runs just after the last event)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        report = engine.load_report()
        if report.running == report.queued == 0:
            return True
        time.sleep(0.01)
    return False


def completion(prompt: str | tuple[int, ...] = "hello", continuation: tuple[int, ...] = (),
               **params: object) -> CompletionRequest:
    return CompletionRequest(model="tiny", prompt=prompt, params=GenerationParams(**params),  # type: ignore[arg-type]
                             continuation=continuation)


def test_usage_counts_prompt_and_generated_tokens(engine: LlamaEngine) -> None:
    request = completion("hello", max_tokens=7, seed=1)
    events = run(engine, request)
    finish = events[-1]
    assert isinstance(finish, Finish) and finish.reason == "length"
    # byte vocabulary: BOS, llama.cpp's space prefix ("\u2581", 3 bytes), then one token per byte
    assert finish.usage.prompt_tokens == len(engine.prompt_tokens(request)) == 1 + 3 + len(b"hello")
    assert finish.usage.completion_tokens == 7 == len(tokens_of(events))
    assert all(isinstance(e, TextDelta) for e in events[:-1])


def test_chat_uses_fallback_format_for_template_less_llama(engine: LlamaEngine) -> None:
    assert engine.chat_format == "llama-2"
    request = ChatRequest(model="tiny", messages=(ChatMessage("system", "be brief"), ChatMessage("user", "hi")),
                          params=GenerationParams(max_tokens=5, seed=3))
    finish = run(engine, request)[-1]
    assert isinstance(finish, Finish)
    assert finish.usage.prompt_tokens == len(engine.prompt_tokens(request)) > len(b"be brief hi")


def test_stop_string_cuts_text_before_it(engine: LlamaEngine) -> None:
    full = text_of(run(engine, completion("xyz", max_tokens=40, temperature=0.0)))
    stop = full[5:7]
    assert stop and stop not in full[:5]
    events = run(engine, completion("xyz", max_tokens=40, temperature=0.0, stop=(stop,)))
    assert text_of(events) == full[: full.index(stop)]
    assert isinstance(events[-1], Finish) and events[-1].reason == "stop"


def test_max_tokens_is_clamped_to_the_slot_context(engine: LlamaEngine) -> None:
    finish = run(engine, completion("a" * 200, max_tokens=10_000, temperature=0.0))[-1]
    assert isinstance(finish, Finish) and finish.reason in ("length", "stop")
    assert finish.usage.prompt_tokens + finish.usage.completion_tokens <= engine.context_length == 256


def test_requests_without_max_tokens_get_the_default_cap(tiny: Path) -> None:
    eng = LlamaEngine(tiny, n_ctx=256, n_threads=1, parallel=1, default_max_tokens=9)
    asyncio.run(eng.load())
    try:
        finish = run(eng, completion("hello", temperature=0.0))[-1]
        assert isinstance(finish, Finish) and finish.usage.completion_tokens == 9 and finish.reason == "length"
    finally:
        asyncio.run(eng.close())


def test_prompt_longer_than_context_is_refused(engine: LlamaEngine) -> None:
    with pytest.raises(PromptTooLong):
        run(engine, completion("a" * 300))


def test_token_id_prompts_are_fed_as_they_are(engine: LlamaEngine) -> None:
    ids = tuple(engine.prompt_tokens(completion("token ids")))
    as_text = run(engine, completion("token ids", max_tokens=12, temperature=0.0))
    as_ids = run(engine, completion(ids, max_tokens=12, temperature=0.0))
    assert text_of(as_ids) == text_of(as_text) and as_ids[-1] == as_text[-1]


@pytest.mark.parametrize(("prompt", "continuation", "what"), [
    ((1, 2, 259), (), "the prompt holds token id 259"),
    ((1, -1), (), "the prompt holds token id -1"),
    ((), (), "the prompt is empty"),
    ("ok", (5, 10**6), "the continuation holds token id 1000000"),
])
def test_bad_token_ids_are_refused_before_anything_runs(engine: LlamaEngine, prompt: str | tuple[int, ...],
                                                         continuation: tuple[int, ...], what: str) -> None:
    before = engine.stats.requests
    with pytest.raises(InvalidRequest, match=re.escape(what)):
        run(engine, completion(prompt, continuation, max_tokens=4))
    assert engine.stats.requests == before


def test_continuation_counts_in_usage_and_against_max_tokens(engine: LlamaEngine) -> None:
    full = run(engine, completion("resume me", max_tokens=20, temperature=0.0))
    tokens = tokens_of(full)
    assert len(tokens) == 20
    resumed = run(engine, completion("resume me", tuple(tokens[:5]), max_tokens=20, temperature=0.0))
    assert tokens_of(resumed) == tokens[5:]
    assert resumed[-1] == full[-1]  # same usage: 20 completion tokens, the 5 replayed ones included
    done = run(engine, completion("resume me", tuple(tokens), max_tokens=20, temperature=0.0))
    assert done[-1] == full[-1] and tokens_of(done) == []  # nothing left to generate
    assert text_of(full).endswith(text_of(done))  # only text the first engine still held back (a split character)


@pytest.fixture(scope="module")
def padded(tiny: Path) -> Iterator[LlamaEngine]:
    """The engine as it runs where a lone row computes differently (each one then decodes beside a pad)."""
    eng = LlamaEngine(tiny, n_ctx=256, n_threads=1, parallel=4, pad_lone_rows=True)
    asyncio.run(eng.load())
    yield eng
    asyncio.run(eng.close())


@pytest.mark.parametrize("kind", ["engine", "padded"])
def test_a_continuation_is_decoded_by_rows_unless_that_would_take_too_long(
        kind: str, request: pytest.FixtureRequest) -> None:
    engine: LlamaEngine = request.getfixturevalue(kind)
    tokens = tokens_of(run(engine, completion("resume me", max_tokens=20, temperature=0.0)))

    def rows(steps_s: float) -> tuple[int, Finish]:
        engine.replay_steps_s, before = steps_s, engine.stats.decode_rows
        try:
            events = run(engine, completion("resume me", tuple(tokens[:5]), max_tokens=20, temperature=0.0))
        finally:
            engine.replay_steps_s = REPLAY_STEPS_S
        assert isinstance(events[-1], Finish) and len(tokens_of(events)) == 15
        return engine.stats.decode_rows - before, events[-1]

    (by_rows, finish), (prefilled, same) = rows(REPLAY_STEPS_S), rows(0.0)
    assert by_rows - prefilled == 5  # the sent tokens went in with the prompt's prefill instead
    assert finish.usage == same.usage


def test_grammar_constrains_every_token(engine: LlamaEngine) -> None:
    grammar = 'root ::= "ab" [cd]{3} (" " [0-9]{1,3})? "!"'
    for params in ({"temperature": 0.0}, {"temperature": 1.0, "seed": 4}, {"temperature": 1.5, "seed": 9, "top_k": 50}):
        events = run(engine, completion("grammar", max_tokens=30, grammar=grammar, **params))
        assert re.fullmatch(r"ab[cd]{3}( [0-9]{1,3})?!", text_of(events)), text_of(events)
        assert isinstance(events[-1], Finish) and events[-1].reason == "stop"


def test_a_bad_grammar_is_refused_before_anything_runs(engine: LlamaEngine) -> None:
    with pytest.raises(BadGrammar, match="minimum above its maximum"):
        run(engine, completion("x", grammar='root ::= "a"{2,1}'))
    with pytest.raises(BadGrammar, match=r"llama\.cpp refused"):
        run(engine, completion("x", grammar="root ::= root [a]"))
    with pytest.raises(InvalidRequest, match="not allowed by the request's grammar"):
        run(engine, completion("x", (ord("z") + 3,), grammar='root ::= "a"'))  # byte token 'z' then EOS


def test_logprobs_come_from_the_raw_distribution(engine: LlamaEngine) -> None:
    events = run(engine, completion("logprobs", max_tokens=10, temperature=0.0, logprobs=3))
    deltas = [e for e in events if isinstance(e, TextDelta)]
    entries = [lp for d in deltas for lp in d.logprobs]
    assert [lp.token_id for lp in entries] == tokens_of(events) and len(entries) == 10
    for lp in entries:
        assert len(lp.top) == 3 and lp.top[0].token_id == lp.token_id  # greedy takes the most likely
        assert lp.logprob == lp.top[0].logprob <= 0.0
        assert [t.logprob for t in lp.top] == sorted((t.logprob for t in lp.top), reverse=True)
        assert sum(2.718281828 ** t.logprob for t in lp.top) <= 1.0 + 1e-6
    with pytest.raises(InvalidRequest, match="logprobs"):
        run(engine, completion("x", logprobs=21))
    sampled = run(engine, completion("logprobs", max_tokens=10, temperature=1.0, seed=5, logprobs=0))
    assert all(lp.top == () and lp.logprob <= 0.0 for e in sampled if isinstance(e, TextDelta) for lp in e.logprobs)


def test_closing_the_stream_cancels_between_tokens(engine: LlamaEngine) -> None:
    before = engine.stats.cancelled, engine.stats.completion_tokens

    async def read_two() -> None:
        stream = engine.generate(completion("go", max_tokens=200, temperature=0.0))
        await anext(stream)
        await anext(stream)
        await stream.aclose()  # type: ignore[attr-defined]
        await until(lambda: engine.stats.cancelled > before[0], 5.0)

    asyncio.run(read_two())
    assert engine.stats.cancelled == before[0] + 1
    assert engine.stats.completion_tokens - before[1] < 200
    assert idle(engine)


def test_a_request_cancelled_while_it_is_prepared_frees_its_samplers(engine: LlamaEngine,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """The client goes away while the worker thread tokenizes the prompt and builds the samplers (native
    llama.cpp memory, a grammar's among them): they are freed once the thread is done."""
    prepared: list[object] = []
    gone = threading.Event()
    real = engine._prepare

    def prepare(request):  # type: ignore[no-untyped-def]
        job = real(request)
        prepared.append(job)
        assert gone.wait(10), "the caller was never cancelled"  # the caller is cancelled meanwhile
        return job

    monkeypatch.setattr(engine, "_prepare", prepare)

    async def cancelled() -> None:
        task = asyncio.ensure_future(anext(engine.generate(completion("go", max_tokens=8, temperature=0.7))))
        await until(lambda: bool(prepared), 10.0)  # the worker thread holds the samplers now
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        gone.set()
        await until(lambda: prepared[0].sampler.chain.ptr is None, 10.0)  # type: ignore[attr-defined]

    asyncio.run(cancelled())
    (job,) = prepared
    assert job.sampler is not None and job.sampler.chain is not None  # type: ignore[attr-defined]
    assert job.sampler.chain.ptr is None  # type: ignore[attr-defined]  # freed
    assert idle(engine)


@pytest.fixture
def slow(tiny: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[LlamaEngine]:
    """One slot, two queue places, and steps slowed to ~5 ms so requests overlap for sure."""
    eng = LlamaEngine(tiny, n_ctx=256, n_threads=1, parallel=1, max_queue=2, queue_timeout_s=0.3)
    asyncio.run(eng.load())
    original = eng._run

    def slow_run(step: object) -> None:
        time.sleep(0.005)
        original(step)  # type: ignore[arg-type]

    monkeypatch.setattr(eng, "_run", slow_run)
    yield eng
    asyncio.run(eng.close())


def test_full_queue_is_refused_with_engine_busy_and_a_retry_hint(slow: LlamaEngine) -> None:
    slow.queue_timeout_s = 60.0  # only the queue bound refuses here

    async def flood() -> list[BaseException | None]:
        async def one(i: int) -> BaseException | None:
            try:
                async for _ in slow.generate(completion(f"q{i}", max_tokens=20)):
                    pass
            except EngineBusy as exc:
                return exc
            return None

        running = slow.generate(completion("running", max_tokens=60, temperature=0.0))
        await anext(running)  # the one slot is taken
        try:
            return await asyncio.gather(*(one(i) for i in range(5)))
        finally:
            await running.aclose()  # type: ignore[attr-defined]

    outcomes = asyncio.run(flood())
    refused = [o for o in outcomes if isinstance(o, EngineBusy)]
    assert len(refused) == 3 and all(1.0 <= o.retry_after_s <= 60.0 for o in refused)  # two queue places
    assert all("2 of the 2 queue places" in str(o) for o in refused)
    assert idle(slow) and slow.load_report().max_queue == 2 and slow.load_report().slots == 1


def test_a_request_waiting_too_long_is_refused(slow: LlamaEngine) -> None:
    async def scenario() -> BaseException | None:
        long = slow.generate(completion("long", max_tokens=250, temperature=0.0))
        await anext(long)
        try:
            async for _ in slow.generate(completion("late", max_tokens=5)):
                pass
        except EngineBusy as exc:
            return exc
        finally:
            await long.aclose()  # type: ignore[attr-defined]
        return None

    exc = asyncio.run(scenario())
    assert isinstance(exc, EngineBusy) and "waited over 0.3s" in str(exc)


def test_close_ends_running_requests_with_an_error(tiny: Path) -> None:
    eng = LlamaEngine(tiny, n_ctx=256, n_threads=1, parallel=1)
    asyncio.run(eng.load())

    async def scenario() -> None:
        stream = eng.generate(completion("closing", max_tokens=250, temperature=0.0))
        await anext(stream)
        await eng.close()
        with pytest.raises(EngineNotLoaded):
            async for _ in stream:
                pass
        with pytest.raises(EngineNotLoaded):
            await anext(eng.generate(completion("after")))

    asyncio.run(scenario())


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


@pytest.mark.parametrize("where", ["plan", "decode"])
def test_a_failing_step_ends_its_requests_with_an_error_and_the_engine_carries_on(
        tiny: Path, monkeypatch: pytest.MonkeyPatch, where: str) -> None:
    eng = LlamaEngine(tiny, n_ctx=256, n_threads=1, parallel=2)
    asyncio.run(eng.load())
    try:
        target = eng._sched if where == "plan" else eng._ctx
        original = getattr(target, where)
        calls = {"n": 0}

        def fail_once(*args: object) -> object:
            calls["n"] += 1
            if calls["n"] == 3:
                raise RuntimeError(f"injected {where} failure")
            return original(*args)

        monkeypatch.setattr(target, where, fail_once)
        with pytest.raises(EngineError, match=f"injected {where} failure"):
            run(eng, completion("doomed", max_tokens=50, temperature=0.0))
        finish = run(eng, completion("next", max_tokens=5, temperature=0.0))[-1]
        assert isinstance(finish, Finish) and finish.usage.completion_tokens == 5
        assert idle(eng)
    finally:
        asyncio.run(eng.close())
