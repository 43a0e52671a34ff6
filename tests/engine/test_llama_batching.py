"""Many requests on one LlamaEngine: one batch per step, the same answer whatever else runs, prompt-cache
reuse that changes nothing, seeded resume, cancellation that frees a slot at once, fair turns."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from unittest import mock

import pytest
from tinymodels import write_tiny_gemma3, write_tiny_llama

from meshllm.engine.base import CompletionRequest, Finish, GenerationEvent, GenerationParams, TextDelta
from meshllm.engine.llama import LlamaEngine

PROMPT = "The history of the printing press begins in the fifteenth century, when movable type " * 2
OTHERS = [f"Another request, number {i}, about something else entirely. " * (1 + i % 3) for i in range(7)]


@pytest.fixture(scope="module", params=["llama", "gemma3"])
def engine(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LlamaEngine]:
    folder = tmp_path_factory.mktemp("m")
    path = write_tiny_llama(folder / "tiny.gguf", seed=2) if request.param == "llama" else \
        write_tiny_gemma3(folder / "tiny-gemma3.gguf", seed=2, sliding_window=64)
    eng = LlamaEngine(path, n_ctx=512, n_threads=1, parallel=8)
    asyncio.run(eng.load())
    yield eng
    asyncio.run(eng.close())


def req(prompt: str, max_tokens: int = 48, continuation: tuple[int, ...] | list[int] = (),
        **params: object) -> CompletionRequest:
    params.setdefault("temperature", 0.0)
    return CompletionRequest(model="m", prompt=prompt, params=GenerationParams(max_tokens=max_tokens, **params),  # type: ignore[arg-type]
                             continuation=tuple(continuation))


async def collect(engine: LlamaEngine, request: CompletionRequest,
                  streaming: asyncio.Event | None = None) -> tuple[str, list[int], Finish]:
    """The request's text, tokens and finish; ``streaming`` is set at its first delta."""
    text, tokens = "", []
    async for event in engine.generate(request):
        if isinstance(event, TextDelta):
            text, tokens = text + event.text, tokens + list(event.tokens)
            if streaming is not None:
                streaming.set()
        else:
            return text, tokens, event
    raise AssertionError("no finish")


def one(engine: LlamaEngine, request: CompletionRequest) -> tuple[str, list[int], Finish]:
    return asyncio.run(collect(engine, request))


async def wait_running(engine: LlamaEngine, n: int, timeout_s: float = 10.0, *, what: str = "running") -> None:
    """Until ``n`` requests are ``what`` (``running`` or ``queued``) in the engine's load report."""
    deadline = time.monotonic() + timeout_s
    while getattr(engine.load_report(), what) < n:
        assert time.monotonic() < deadline, f"never {n} {what}: {engine.load_report()}"
        await asyncio.sleep(0.001)


async def alongside(engine: LlamaEngine, request: CompletionRequest, n_others: int) -> tuple[str, list[int], Finish]:
    """``request`` while ``n_others`` long requests are generating in the other slots, in one batch.

    Where one-row calls are measured faster the engine runs a batch's rows one by one (``CallCosts``),
    which a loaded host's timings can suggest for any model; ``request`` would then compute alone, and
    the batch this helper is for would not happen, so the engine is held to whole batches meanwhile.
    The others are cancelled once ``request`` has finished: the rest of their tokens would prove nothing
    (on the default model they cost half a minute)."""
    streaming = [asyncio.Event() for _ in OTHERS[:n_others]]
    others = [asyncio.ensure_future(collect(engine, req(p, 300), s)) for p, s in zip(OTHERS, streaming, strict=False)]
    # every other is generating (polling for n running at one moment missed it on a loaded host: the
    # first ones can finish their 300 tokens before the last one's prompt is in)
    async with asyncio.timeout(30):
        await asyncio.gather(*(s.wait() for s in streaming))
    calls, rows = engine.stats.decode_calls, engine.stats.decode_rows
    with mock.patch.object(engine._costs, "split", return_value=False):
        result = await collect(engine, request)
    assert (engine.stats.decode_rows - rows) / (engine.stats.decode_calls - calls) > 1.5  # it really was batched
    for other in others:
        other.cancel()
    await asyncio.gather(*others, return_exceptions=True)
    return result


def test_same_greedy_request_same_text_alone_after_others_after_itself_and_among_seven(engine: LlamaEngine) -> None:
    request = req(PROMPT)
    alone = one(engine, request)
    one(engine, req("something unrelated that fills a slot with other tokens " * 3))
    after_unrelated = one(engine, request)
    after_itself = one(engine, request)
    among_seven = asyncio.run(alongside(engine, request, 7))
    assert alone[1] and alone[:2] == after_unrelated[:2] == after_itself[:2] == among_seven[:2]
    assert after_itself[2].usage.cached_tokens > 0 and alone[2].usage.cached_tokens == 0
    assert after_itself[2].usage.prompt_tokens == alone[2].usage.prompt_tokens


def test_a_fixed_seed_gives_the_same_text_whatever_runs(engine: LlamaEngine) -> None:
    request = req(PROMPT, temperature=0.9, seed=1234)
    first, second = one(engine, request), one(engine, request)
    among = asyncio.run(alongside(engine, request, 3))
    assert first[:2] == second[:2] == among[:2]
    assert one(engine, req(PROMPT, temperature=0.9, seed=99))[1] != first[1]


def test_a_resumed_request_continues_exactly_where_the_first_engine_was(engine: LlamaEngine) -> None:
    request = req(PROMPT, 40, temperature=0.8, seed=7)
    _, tokens, finish = one(engine, request)
    for k in (1, 13, len(tokens) - 1):
        resumed = one(engine, req(PROMPT, 40, temperature=0.8, seed=7, continuation=tokens[:k]))
        assert resumed[1] == tokens[k:]
        assert resumed[2].usage.completion_tokens == finish.usage.completion_tokens


def test_a_longer_prompt_reuses_the_cached_chunks_of_a_shorter_one(engine: LlamaEngine) -> None:
    base = one(engine, req(PROMPT, 8))
    longer = req(PROMPT + " And then more text follows.", 24)
    cached = one(engine, longer)
    assert cached[2].usage.cached_tokens == (base[2].usage.prompt_tokens // engine.prefill_chunk) * engine.prefill_chunk
    fresh = LlamaEngine(engine.path, n_ctx=512, n_threads=1, parallel=1)
    asyncio.run(fresh.load())
    try:
        assert one(fresh, longer)[:2] == cached[:2]
    finally:
        asyncio.run(fresh.close())


def test_cancelling_one_of_eight_frees_its_slot_at_once_and_leaves_the_others_alone(
        engine: LlamaEngine, monkeypatch: pytest.MonkeyPatch) -> None:
    prompts = [f"Stream {i} tells its own story about rivers and valleys. " for i in range(8)]
    reference = [one(engine, req(p, 120)) for p in prompts]
    # "at once" counted in decode steps, not seconds (a loaded host stretches seconds), and read on the
    # engine's side when the slot is freed (the event loop may wake only steps later on a busy host)
    assert engine._sched is not None
    freed_at: list[int] = []
    scheduler_cancel = engine._sched.cancel
    monkeypatch.setattr(engine._sched, "cancel",
                        lambda job: freed_at.append(engine.stats.decode_calls) or scheduler_cancel(job))

    async def scenario() -> tuple[int, list[tuple[str, list[int], Finish]]]:
        victim = engine.generate(req(prompts[3], 400))
        await anext(victim)
        others = [asyncio.ensure_future(collect(engine, req(p, 120))) for i, p in enumerate(prompts) if i != 3]
        await wait_running(engine, 8)
        await victim.aclose()  # type: ignore[attr-defined]
        steps_at_cancel, deadline = engine.stats.decode_calls, time.monotonic() + 30.0
        while engine.load_report().running > 7:
            assert time.monotonic() < deadline, "the cancelled request kept its slot"
            await asyncio.sleep(0.0005)
        return steps_at_cancel, await asyncio.gather(*others)

    steps_at_cancel, results = asyncio.run(scenario())
    # the step in flight at the cancel may finish; the slot is free before the one after it starts
    assert len(freed_at) == 1 and freed_at[0] - steps_at_cancel <= 1, (steps_at_cancel, freed_at)
    assert [r[:2] for r in results] == [r[:2] for i, r in enumerate(reference) if i != 3]


def test_steps_batch_every_generating_slot(engine: LlamaEngine) -> None:
    calls, rows = engine.stats.decode_calls, engine.stats.decode_rows

    async def eight() -> list[tuple[str, list[int], Finish]]:
        return await asyncio.gather(*(collect(engine, req(f"batch {i} " * 4, 64)) for i in range(8)))

    results = asyncio.run(eight())
    generated = sum(len(r[1]) for r in results)
    by_length = sum(r[2].reason == "length" for r in results)
    # every token is decoded once, but a first token comes from its prefill and a last one (at the length
    # limit) is never fed back
    assert engine.stats.decode_rows - rows == generated - by_length
    # one call per step: no more calls than the longest request had steps (plus the staggered starts)
    assert engine.stats.decode_calls - calls <= max(len(r[1]) for r in results) + 8


def test_clients_take_turns_for_a_single_slot(tmp_path: Path) -> None:
    eng = LlamaEngine(write_tiny_llama(tmp_path / "tiny.gguf"), n_ctx=256, n_threads=1, parallel=1)
    asyncio.run(eng.load())
    order: list[str] = []

    async def tracked(name: str, client: str) -> None:
        # greedy and long: the flood's first request is still running when its last one queues
        request = CompletionRequest(model="m", prompt=name, client=client,
                                    params=GenerationParams(max_tokens=200, temperature=0.0))
        stream: AsyncIterator[GenerationEvent] = eng.generate(request)
        async for _ in stream:
            if name not in order:
                order.append(name)

    async def scenario() -> None:
        flood = [asyncio.ensure_future(tracked(f"flood{i}", "user:flood")) for i in range(4)]
        await wait_running(eng, 1)
        await wait_running(eng, 3, what="queued")
        await asyncio.gather(*flood, tracked("polite", "user:polite"))

    try:
        asyncio.run(scenario())
    finally:
        asyncio.run(eng.close())
    assert order.index("polite") <= 2  # served after at most one more of the flood, not after all of it


def test_hybrid_model_serves_without_rewinds(tmp_path: Path) -> None:
    """Qwen 3.5 (recurrent layers): llama.cpp cannot cut a recurrent state back, so the engine reuses no
    cached prefix, pads no row into another sequence and does not speculate; the text is the same alone,
    after itself and among others."""
    from tinymodels import write_tiny

    eng = LlamaEngine(write_tiny("qwen35", tmp_path / "q35.gguf", weight_type="Q8_0", seed=2), n_ctx=512,
                      n_threads=1, parallel=4, speculate="on")
    asyncio.run(eng.load())
    try:
        assert eng.speculate == "off" and "recurrent" in str(eng.unavailable)
        request = req(PROMPT)
        alone = one(eng, request)
        after_itself = one(eng, request)
        among = asyncio.run(alongside(eng, request, 3))
        assert alone[1] and alone[:2] == after_itself[:2] == among[:2]
        assert after_itself[2].usage.cached_tokens == 0
    finally:
        asyncio.run(eng.close())
