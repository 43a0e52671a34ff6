"""Replay of a generation broken mid-answer: the sans-IO rules, and exactness on a real llama.cpp engine.

The engine test cuts a real stream after every one of its deltas, replays the rest on a second
engine (another llama.cpp context over the same file) from what :class:`Progress` recorded, and
checks that what a client would see, joined, is the uninterrupted answer: text, logprobs, usage
and finish reason. The tiny model has a byte vocabulary, so characters split across tokens and
stop strings held back across deltas are covered.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest
from gguf import GGMLQuantizationType
from tinymodels import write_tiny_llama

from meshllm.engine.base import (
    ChatMessage,
    ChatRequest,
    CompletionRequest,
    Finish,
    GenerationEvent,
    GenerationParams,
    GenerationRequest,
    TextDelta,
    Usage,
)
from meshllm.engine.llama import LlamaEngine
from meshllm.engine.text import TextStream
from meshllm.runtime.errors import BadRequest, NoCapacity, UpstreamError, UpstreamTimeout
from meshllm.runtime.replay import Progress, ReplayPolicy, seeded


def completion(**params: object) -> CompletionRequest:
    return CompletionRequest(model="tiny", prompt="Once upon a time", params=GenerationParams(**params))  # type: ignore[arg-type]


# ---- the rules (sans-IO) -------------------------------------------------------------------------

def test_a_sampled_request_without_seed_gets_one_and_nothing_else_changes() -> None:
    sampled = completion(temperature=0.7, max_tokens=9)
    first, second = seeded(sampled), seeded(sampled)
    assert first.params.seed is not None and 0 <= first.params.seed < 2**63
    assert first.params.seed != second.params.seed  # random, like an unseeded request
    assert first.params == GenerationParams(temperature=0.7, max_tokens=9, seed=first.params.seed)
    for kept in (completion(temperature=0.0), completion(temperature=0.7, seed=5)):
        assert seeded(kept) is kept


def test_progress_records_the_ids_sent_and_builds_the_continuation() -> None:
    request = CompletionRequest(model="m", prompt="p", continuation=(1, 2))
    progress = Progress(request)
    for event in (TextDelta("a", (3,)), TextDelta("bc", (4, 5, 6)), TextDelta("", (7,))):
        progress.sent(event, 0.0)
    assert progress.why_not(UpstreamError("peer gone")) is None
    replay = progress.begin("node-a")
    assert replay.continuation == (1, 2, 3, 4, 5, 6, 7) and replay.prompt == "p"
    assert progress.replays == 1 and progress.failed == {"node-a"}


@pytest.mark.parametrize(("events", "exc", "why"), [
    ((), BadRequest("bad field"), "the request's own"),
    ((TextDelta("x", ()),), UpstreamError("gone"), "did not report token ids"),
    ((TextDelta("x", (1,)), Finish(reason="stop", usage=Usage(1, 1))), UpstreamError("gone"), "already ended"),
])
def test_what_is_never_replayed(events: tuple[GenerationEvent, ...], exc: Exception, why: str) -> None:
    progress = Progress(completion())
    for event in events:
        progress.sent(event, 0.0)
    assert why in (progress.why_not(exc) or "")


def test_a_tail_without_token_ids_is_still_replayable() -> None:
    """The length limit cut a character in half: the tail is its replacement mark, and its token was
    sent already with the text before it. A replacement's text is then all sent: only its finish passes."""
    text = TextStream(is_end=lambda _t: False, token_bytes={1: b"a", 2: "b\u00e9".encode()[:2]}.__getitem__,
                      stops=(), limit=2, prompt_tokens=3)
    events = [text.feed(1), text.feed(2), *text.finish()]
    tail = events[2]
    assert isinstance(tail, TextDelta) and tail.final and tail.text == "\ufffd" and tail.tokens == ()
    progress = Progress(completion())
    for event in events[:3]:
        assert event is not None
        progress.sent(event, 0.0)
    assert progress.why_not(UpstreamError("gone")) is None and progress.tokens == [1, 2]
    assert not progress.passes(TextDelta("x", (9,))) and progress.passes(Finish(reason="length", usage=Usage(3, 2)))


def test_at_most_max_replays() -> None:
    progress = Progress(completion(), ReplayPolicy(max_replays=2))
    for node in ("a", "b"):
        assert progress.why_not(UpstreamTimeout("slow")) is None
        progress.begin(node)
    assert progress.why_not(NoCapacity("x")) == "it was already replayed 2 times"
    assert Progress(completion(), ReplayPolicy(max_replays=0)).why_not(UpstreamError("x")) == "replays are off"


# ---- exactness on llama.cpp ----------------------------------------------------------------------

@pytest.fixture(scope="module")
def engines(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LlamaEngine, LlamaEngine]]:
    """Two engines over one file: the node that breaks and the node that continues."""
    path: Path = write_tiny_llama(tmp_path_factory.mktemp("m") / "tiny.gguf", seed=4)
    pair = (LlamaEngine(path, n_ctx=512, n_threads=1, parallel=2), LlamaEngine(path, n_ctx=512, n_threads=1))
    for engine in pair:
        asyncio.run(engine.load())
    yield pair
    for engine in pair:
        asyncio.run(engine.close())


async def events_of(engine: LlamaEngine, request: GenerationRequest) -> list[GenerationEvent]:
    return [event async for event in engine.generate(request)]


def seen(events: list[GenerationEvent]) -> tuple[str, list[object], Finish]:
    """What a client sees: the text, the logprobs, and the finish (without the cache's share of usage)."""
    finish = events[-1]
    assert isinstance(finish, Finish)
    deltas = [e for e in events if isinstance(e, TextDelta)]
    usage = Usage(finish.usage.prompt_tokens, finish.usage.completion_tokens)
    return "".join(d.text for d in deltas), [lp for d in deltas for lp in d.logprobs], \
        Finish(reason=finish.reason, usage=usage, stop_sequence=finish.stop_sequence)


CASES = {
    "greedy": completion(temperature=0.0, max_tokens=40, logprobs=2),
    "sampled, no seed": completion(temperature=0.9, top_p=0.95, max_tokens=40),
    "seeded, ends inside a character": completion(temperature=0.9, top_p=0.95, max_tokens=40, seed=1),
    "seeded, penalties": completion(temperature=1.1, seed=77, top_k=40, presence_penalty=0.5, max_tokens=40),
    "chat, greedy": ChatRequest(model="tiny", messages=(ChatMessage("user", "hello there"),),
                                params=GenerationParams(temperature=0.0, max_tokens=40)),
}


@pytest.mark.parametrize("name", CASES)
def test_a_stream_cut_after_any_delta_continues_exactly_on_another_engine(
        engines: tuple[LlamaEngine, LlamaEngine], name: str) -> None:
    """Every cut, the one between the tail delta (held-back text) and the finish included."""
    first, second = engines
    for _ in range(5):  # an unseeded case draws its seed here; a draw that ends at once cuts nowhere much
        request = seeded(CASES[name])
        full = asyncio.run(events_of(first, request))
        if len(full) > 10:
            break
    assert len(full) > 10
    for cut in range(len(full)):
        progress = Progress(request)
        for event in full[:cut]:
            progress.sent(event, 0.0)
        assert progress.why_not(UpstreamError("the serving node became unreachable")) is None
        rest = [e for e in asyncio.run(events_of(second, progress.begin("first"))) if progress.passes(e)]
        assert seen(full[:cut] + rest) == seen(full), f"{name}: cut after {cut} events"


def test_a_stop_string_held_back_at_the_cut_is_still_found(engines: tuple[LlamaEngine, LlamaEngine]) -> None:
    first, second = engines
    text = seen(asyncio.run(events_of(first, completion(temperature=0.0, max_tokens=40))))[0]
    stop = text[20:23]
    assert stop and stop not in text[:20]
    request = completion(temperature=0.0, max_tokens=40, stop=(stop, "never appears in it"))
    full = asyncio.run(events_of(first, request))
    assert seen(full)[0] == text[:20] and seen(full)[2].stop_sequence == stop
    for cut in range(len(full)):
        progress = Progress(request)
        for event in full[:cut]:
            progress.sent(event, 0.0)
        rest = asyncio.run(events_of(second, progress.begin("first")))
        assert seen(full[:cut] + [e for e in rest if progress.passes(e)]) == seen(full)


def test_a_stall_is_a_silence_much_longer_than_the_streams_gaps() -> None:
    progress = Progress(completion(), ReplayPolicy(stall_factor=8.0, stall_min_s=0.3, stall_after=8, max_replays=1))
    for i in range(7):
        progress.sent(TextDelta("x", (i,)), now=i * 0.01)
        assert progress.stall_s() is None  # too early to know the stream's pace
    progress.sent(TextDelta("x", (7,)), now=0.07)
    assert progress.stall_s() == pytest.approx(0.3)  # 8 x 10 ms is below the floor
    for i in range(8, 40):
        progress.sent(TextDelta("x", (i,)), now=0.07 + (i - 7) * 0.1)
    assert progress.stall_s() == pytest.approx(0.8, rel=0.05)  # 8 x the recent 100 ms gaps
    progress.begin("a")
    assert progress.stall_s() is None  # no replay left to hedge with
    assert Progress(completion(), ReplayPolicy(hedge=False)).stall_s() is None


def test_replayed_tokens_skip_the_output_head_and_change_nothing(tmp_path_factory: pytest.TempPathFactory) -> None:
    """With row-exact kernels (a quantized model: no padding) a continuation's rows compute the layers
    only, since the next token is known: alone (a call with no output row) and beside another slot's
    generation in one batch. Neither answer changes."""
    path = write_tiny_llama(tmp_path_factory.mktemp("q8") / "q8.gguf", seed=4, weight_type=GGMLQuantizationType.Q8_0)
    engine = LlamaEngine(path, n_ctx=512, n_threads=1, parallel=2)
    asyncio.run(engine.load())
    try:
        assert not engine.pad_lone_rows
        request, other = completion(temperature=0.0, max_tokens=40), completion(temperature=0.0, max_tokens=60)
        other = msgspec.structs.replace(other, prompt="A different story")

        def ids(events: list[GenerationEvent]) -> list[int]:
            return [t for e in events if isinstance(e, TextDelta) for t in e.tokens]

        tokens, other_tokens = ids(asyncio.run(events_of(engine, request))), ids(asyncio.run(events_of(engine, other)))
        resume = msgspec.structs.replace(request, continuation=tuple(tokens[:30]))
        before = engine.stats.headless_rows
        assert ids(asyncio.run(events_of(engine, resume))) == tokens[30:]
        assert engine.stats.headless_rows - before == 29  # the 30th row's logits give the 31st token

        async def side_by_side() -> tuple[list[GenerationEvent], list[GenerationEvent]]:
            return await asyncio.gather(events_of(engine, other), events_of(engine, resume))

        beside, resumed = asyncio.run(side_by_side())
        assert ids(resumed) == tokens[30:] and ids(beside) == other_tokens
        assert engine.stats.headless_rows - before == 58
    finally:
        asyncio.run(engine.close())
