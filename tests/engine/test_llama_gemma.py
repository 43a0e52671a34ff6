"""The bundled Gemma 3 270M Q4_K_M gives the same answer whatever ran before or beside it.

With the row-exact kernels (``kernels="exact"``, the default) llama.cpp computes each row the same
way whatever the batch holds, so the same greedy request gives the same tokens alone, after another
request, after itself (a prompt-cache hit), among seven others, and resumed from a continuation.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest
from test_llama_batching import OTHERS, alongside, one, req

from meshllm.engine.llama import LlamaEngine
from meshllm.models import resolve_model

PROMPT = ("The history of the printing press begins in the fifteenth century, when Johannes Gutenberg, a goldsmith "
          "from Mainz, combined several existing technologies into a system for printing books. Before that time, "
          "books were copied by hand, and a single volume could take a scribe many months. ") * 2


@pytest.fixture(scope="module")
def engine() -> Iterator[LlamaEngine]:
    eng = LlamaEngine(resolve_model("gemma", progress=False), n_ctx=1024, n_threads=1, parallel=8)
    asyncio.run(eng.load())
    yield eng
    asyncio.run(eng.close())


@pytest.mark.slow
def test_gemma_same_request_same_tokens_whatever_runs(engine: LlamaEngine) -> None:
    assert engine.kernels == "exact" and engine.pad_lone_rows is False  # one row alone computes as in a batch
    request = req(PROMPT, 32)
    alone = one(engine, request)
    one(engine, req(OTHERS[0], 16))
    after_unrelated = one(engine, request)
    after_itself = one(engine, request)
    among_seven = asyncio.run(alongside(engine, request, 7))
    assert len(alone[1]) == 32
    assert alone[:2] == after_unrelated[:2] == after_itself[:2] == among_seven[:2]
    assert after_itself[2].usage.cached_tokens == (alone[2].usage.prompt_tokens - 1) // 64 * 64 > 0

    seeded = req(PROMPT, 24, temperature=0.8, seed=21)
    first = one(engine, seeded)
    assert one(engine, seeded)[:2] == first[:2]
    resumed = one(engine, req(PROMPT, 24, continuation=first[1][:9], temperature=0.8, seed=21))
    assert resumed[1] == first[1][9:]
