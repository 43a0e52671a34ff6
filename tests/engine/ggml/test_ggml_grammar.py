"""GgmlEngine's grammars and logprobs, against the llama.cpp engine on the same tiny model.

Both engines compute the same logits up to float rounding (the stage runtime follows llama.cpp's
graphs; on this f32 tiny model they differ in the last bits, so logprobs differ by up to ~2e-4), so
a greedy request under a grammar gives the same text on both, and the logprobs (the raw logits'
softmax on both) agree within 1e-3.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

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
from meshllm.engine.llama import LlamaEngine

WORDS = 'root ::= word (" " word)* "."\nword ::= "cat" | "sat" | "mat" | "on" | "the"'
WORDS_RE = re.compile(r"(cat|sat|mat|on|the)( (cat|sat|mat|on|the))*\.?")


@pytest.fixture(scope="module")
def engines(tiny_llama: Path) -> Iterator[tuple[GgmlEngine, LlamaEngine]]:
    ggml = GgmlEngine(tiny_llama, n_ctx=256, threads=1)
    llama = LlamaEngine(tiny_llama, n_ctx=256, n_threads=1)
    for engine in (ggml, llama):
        asyncio.run(engine.load())
    yield ggml, llama
    for engine in (ggml, llama):
        asyncio.run(engine.close())


async def _events(events: AsyncIterator[GenerationEvent]) -> list[GenerationEvent]:
    return [event async for event in events]


def _run(engine: Engine, request: CompletionRequest) -> tuple[str, tuple[int, ...], list[TokenLogprob], Finish]:
    events = asyncio.run(_events(engine.generate(request)))
    finish = events[-1]
    assert isinstance(finish, Finish)
    deltas = [e for e in events if isinstance(e, TextDelta)]
    return ("".join(d.text for d in deltas), tuple(t for d in deltas for t in d.tokens),
            [lp for d in deltas for lp in d.logprobs], finish)


def _completion(continuation: tuple[int, ...] = (), **params: object) -> CompletionRequest:
    return CompletionRequest(model="tiny", prompt="the cat", params=GenerationParams(**params),  # type: ignore[arg-type]
                             continuation=continuation)


def test_ggml_engine_declares_grammar_and_logprobs(engines: tuple[GgmlEngine, LlamaEngine]) -> None:
    assert {GRAMMAR, LOGPROBS} <= engines[0].supports


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_grammar_holds_and_greedy_text_matches_llama_cpp(engines: tuple[GgmlEngine, LlamaEngine],
                                                        temperature: float) -> None:
    ggml, llama = engines
    request = _completion(grammar=WORDS, max_tokens=40, temperature=temperature, seed=3)
    text, tokens, _, finish = _run(ggml, request)
    assert WORDS_RE.fullmatch(text), text
    assert finish.usage.completion_tokens == len(tokens)
    if temperature == 0.0:
        assert _run(llama, request)[0] == text
    else:  # the same seed draws the same constrained text again
        assert _run(ggml, request)[0] == text


def test_a_complete_grammar_ends_the_text(engines: tuple[GgmlEngine, LlamaEngine]) -> None:
    text, _, _, finish = _run(engines[0], _completion(grammar='root ::= "on the mat"', max_tokens=40, temperature=0))
    assert text == "on the mat" and finish.reason == "stop"


def test_logprobs_match_llama_cpp(engines: tuple[GgmlEngine, LlamaEngine]) -> None:
    ggml, llama = engines
    for grammar in (None, WORDS):
        request = _completion(grammar=grammar, max_tokens=12, temperature=0, logprobs=3)
        _, tokens, mine, _ = _run(ggml, request)
        _, _, theirs, _ = _run(llama, request)
        assert len(mine) == len(theirs) == len(tokens) > 0
        for a, b in zip(mine, theirs, strict=True):
            assert (a.token_id, a.piece) == (b.token_id, b.piece)
            assert a.logprob == pytest.approx(b.logprob, abs=1e-3) and a.logprob <= 0.0
            assert [(t.token_id, t.piece) for t in a.top] == [(t.token_id, t.piece) for t in b.top]
            assert [t.logprob for t in a.top] == pytest.approx([t.logprob for t in b.top], abs=1e-3)
    _, _, none, _ = _run(ggml, _completion(max_tokens=4, temperature=0, logprobs=0))
    assert len(none) == 4 and all(lp.top == () for lp in none)


def test_a_continuation_advances_the_grammar(engines: tuple[GgmlEngine, LlamaEngine]) -> None:
    ggml = engines[0]
    text, tokens, _, _ = _run(ggml, _completion(grammar=WORDS, max_tokens=30, temperature=0))
    rest, rest_tokens, _, finish = _run(ggml, _completion(grammar=WORDS, max_tokens=30, temperature=0,
                                                          continuation=tokens[:5]))
    assert rest_tokens == tokens[5:] and text.endswith(rest)
    assert finish.usage.completion_tokens == len(tokens)
    with pytest.raises(InvalidRequest, match="continuation token 0"):
        _run(ggml, _completion(grammar=WORDS, max_tokens=5, continuation=(ord("x") + 3,)))


def test_bad_grammars_and_logprob_counts_are_refused(engines: tuple[GgmlEngine, LlamaEngine]) -> None:
    ggml = engines[0]
    with pytest.raises(BadGrammar, match=r"undefined|not defined|rule"):
        _run(ggml, _completion(grammar="root ::= nothing", max_tokens=2))
    with pytest.raises(BadGrammar, match=r"llama\.cpp refused"):
        _run(ggml, _completion(grammar='root ::= root "a" | "a"', max_tokens=2))
    with pytest.raises(InvalidRequest, match="logprobs must be between 0 and 20"):
        _run(ggml, _completion(logprobs=21, max_tokens=2))
    assert _run(ggml, _completion(max_tokens=3, temperature=0))[3].usage.completion_tokens == 3  # still serving
