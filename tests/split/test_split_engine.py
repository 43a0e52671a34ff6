"""SplitEngine over a real 2-stage chain: the API's request fields are honoured or refused, never dropped
(grammars and logprobs: test_split_grammar.py)."""

from __future__ import annotations

import asyncio
from pathlib import Path

from split_helpers import MODEL, make_chain

from meshllm.engine.base import CompletionRequest, Finish, GenerationEvent, GenerationParams, TextDelta
from meshllm.split.engine import SplitEngine


async def _events(engine: SplitEngine, request: CompletionRequest) -> list[GenerationEvent]:
    return [e async for e in engine.generate(request)]


def _request(**kwargs: object) -> CompletionRequest:
    continuation = kwargs.pop("continuation", ())
    prompt = kwargs.pop("prompt", "Hello")
    return CompletionRequest(model=MODEL, prompt=prompt, params=GenerationParams(temperature=0.0, **kwargs),  # type: ignore[arg-type]
                             continuation=continuation)  # type: ignore[arg-type]


def test_split_engine_tokens_and_continuation(tiny_model: Path) -> None:
    async def main() -> None:
        chain = await make_chain(tiny_model, [0, 3, 6])
        engine = SplitEngine(tiny_model, MODEL, 256)
        await engine.load()
        engine.attach(chain.coordinator)
        try:
            events = await _events(engine, _request(max_tokens=10))
            tokens = tuple(t for e in events if isinstance(e, TextDelta) for t in e.tokens)
            assert len(tokens) == 10  # every delta carries the ids it stands for
            rest = await _events(engine, _request(max_tokens=10, continuation=tokens[:4]))
            assert tuple(t for e in rest if isinstance(e, TextDelta) for t in e.tokens) == tokens[4:]
            finish = rest[-1]
            assert isinstance(finish, Finish) and finish.usage.completion_tokens == 10
            ids = tuple(engine.tokenizer.encode("Hello"))  # type: ignore[union-attr]
            by_ids = await _events(engine, _request(prompt=ids, max_tokens=10))
            assert [e for e in by_ids if isinstance(e, TextDelta)] == [e for e in events if isinstance(e, TextDelta)]
        finally:
            await engine.close()
            await chain.close()

    asyncio.run(main())
