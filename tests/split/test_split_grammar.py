"""Grammars and logprobs on a split chain over real QUIC endpoints: the last stage samples under the
request's grammar (through speculative windows and continuations) and reports logprobs, and the
text, tokens and logprobs equal what the ggml engine gives for the whole model in one process."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

import pytest
from split_helpers import MODEL, make_chain

from meshllm.engine.base import (
    GRAMMAR,
    LOGPROBS,
    CompletionRequest,
    Engine,
    Finish,
    GenerationEvent,
    GenerationParams,
    InvalidRequest,
    TextDelta,
    TokenLogprob,
)
from meshllm.engine.gbnf import BadGrammar
from meshllm.engine.ggml.engine import GgmlEngine
from meshllm.split import Sampling
from meshllm.split.engine import SplitEngine

WORDS = 'root ::= word (" " word)* "."\nword ::= "the" | "cat" | "sat" | "on" | "mat"'
WORDS_RE = re.compile(r"(the|cat|sat|on|mat)( (the|cat|sat|on|mat))*\.?")
PROMPT = "the cat sat on the mat. the cat sat on the mat. the cat"

Result = tuple[str, tuple[int, ...], list[TokenLogprob], Finish]


async def _run(engine: Engine, continuation: tuple[int, ...] = (), **params: object) -> Result:
    request = CompletionRequest(model=MODEL, prompt=PROMPT, params=GenerationParams(**params),  # type: ignore[arg-type]
                                continuation=continuation)
    events: list[GenerationEvent] = [e async for e in engine.generate(request)]
    finish = events[-1]
    assert isinstance(finish, Finish)
    deltas = [e for e in events if isinstance(e, TextDelta)]
    return ("".join(d.text for d in deltas), tuple(t for d in deltas for t in d.tokens),
            [lp for d in deltas for lp in d.logprobs], finish)


async def _solo(path: Path, calls: list[dict[str, object]]) -> list[Result]:
    engine = GgmlEngine(path, model_id=MODEL, n_ctx=256, threads=1)
    await engine.load()
    try:
        return [await _run(engine, **call) for call in calls]  # type: ignore[arg-type]
    finally:
        await engine.close()


async def _split(path: Path, calls: list[dict[str, object]], speculate: str) -> tuple[list[Result], dict]:
    chain = await make_chain(path, [0, 3, 6], speculate=speculate)
    engine = SplitEngine(path, MODEL, 256)
    await engine.load()
    engine.attach(chain.coordinator)
    try:
        assert {GRAMMAR, LOGPROBS} <= engine.supports
        return [await _run(engine, **call) for call in calls], chain.coordinator.speculation_status()  # type: ignore[arg-type]
    finally:
        await engine.close()
        await chain.close()


CALLS: list[dict[str, object]] = [
    {"grammar": WORDS, "max_tokens": 80, "temperature": 0},
    {"grammar": WORDS, "max_tokens": 80, "temperature": 0.9, "seed": 11},
    {"grammar": WORDS, "max_tokens": 12, "temperature": 0, "logprobs": 3},
    {"max_tokens": 12, "temperature": 0, "logprobs": 3},
]


@pytest.mark.parametrize("speculate", ["off", "on"])
def test_split_grammar_and_logprobs_equal_the_whole_model(tiny_model: Path, speculate: str) -> None:
    solo = asyncio.run(_solo(tiny_model, CALLS))
    split, stats = asyncio.run(_split(tiny_model, CALLS, speculate))
    for call, (text, tokens, logprobs, finish), reference in zip(CALLS, split, solo, strict=True):
        assert (text, tokens, finish.reason) == (*reference[:2], reference[3].reason), call
        if call.get("grammar"):
            assert WORDS_RE.fullmatch(text), text
        if call.get("logprobs"):
            assert len(logprobs) == len(tokens) and all(len(lp.top) == 3 for lp in logprobs)
            for mine, theirs in zip(logprobs, reference[2], strict=True):
                assert (mine.token_id, mine.piece, [t.token_id for t in mine.top]) == \
                    (theirs.token_id, theirs.piece, [t.token_id for t in theirs.top])
                # float32 weights: a chain pads a lone decode row (batch_exact), which rounds the last bits
                # differently from the whole model's one-row kernel
                assert [mine.logprob, *(t.logprob for t in mine.top)] == \
                    pytest.approx([theirs.logprob, *(t.logprob for t in theirs.top)], abs=1e-3)
    if speculate == "on":  # drafts were verified under the grammar: some kept, some rejected
        assert stats["verify_passes"] > 0 and 0 < stats["accepted"] < stats["drafted"], stats


def test_a_continuation_advances_the_last_stages_grammar(tiny_model: Path) -> None:
    async def main() -> None:
        first, = (await _split(tiny_model, [{"grammar": WORDS, "max_tokens": 30, "temperature": 0}], "off"))[0]
        _, tokens, _, _ = first
        calls: list[dict[str, object]] = [
            {"grammar": WORDS, "max_tokens": 30, "temperature": 0, "continuation": tokens[:6]},
            {"grammar": WORDS, "max_tokens": 5, "temperature": 0, "continuation": (ord("x") + 3,)},
        ]
        chain = await make_chain(tiny_model, [0, 3, 6], speculate="off")
        failed: list[object] = []
        chain.coordinator.on_stage_failed = failed.append
        engine = SplitEngine(tiny_model, MODEL, 256)
        await engine.load()
        engine.attach(chain.coordinator)
        try:
            _, rest, _, finish = await _run(engine, **calls[0])  # type: ignore[arg-type]
            assert rest == tokens[6:] and finish.usage.completion_tokens == len(tokens)
            # only the last stage can tell that the grammar forbids it: a 400, and no stage is blamed
            with pytest.raises(InvalidRequest, match="continuation token 0"):
                await _run(engine, **calls[1])  # type: ignore[arg-type]
            with pytest.raises(InvalidRequest, match=r"llama\.cpp refused"):  # left recursion: llama.cpp's check
                await _run(engine, grammar='root ::= root "a" | "a"', max_tokens=3)
            with pytest.raises(BadGrammar):  # refused by the coordinator before the chain sees it
                await _run(engine, grammar='root ::= "a"{2,1}', max_tokens=3)
            # a peer sending a grammar the coordinator would never send gets a clean refusal too
            with pytest.raises(InvalidRequest, match="minimum above its maximum"):
                async for _ in chain.coordinator.generate([1, 2, 3], max_tokens=3,
                                                          sampling=Sampling(grammar='root ::= "a"{2,1}')):
                    pass
            assert not failed and engine.coordinator is chain.coordinator
            assert (await _run(engine, grammar=WORDS, max_tokens=30, temperature=0))[1] == tokens  # still serving
        finally:
            await engine.close()
            await chain.close()

    asyncio.run(main())
