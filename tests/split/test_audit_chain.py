"""Audits against a real in-process chain (QUIC on 127.0.0.1, ggml stages): the recomputation reproduces
what the chain computed, greedy, seeded-sampled and speculative; the workers' records agree with it; a
request recomputed within a small memory bound, range by range, gives the same verdict and rows."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from split_helpers import PROMPT, make_chain

from meshllm.models.gguf_file import GGUFFile
from meshllm.split.audit import Recorder, rows_close
from meshllm.split.auditor import FinishedRequest, recompute
from meshllm.split.control import stage_memory
from meshllm.split.frames import Sampling

pytestmark = pytest.mark.timeout(120)

def sync(fn: Callable[..., Coroutine[Any, Any, None]]) -> Callable[..., None]:
    """Run an async test body in its own event loop (as the other split tests do)."""

    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> None:
        asyncio.run(fn(*args, **kwargs))

    return run


LOOP = PROMPT + PROMPT[1:] + PROMPT[1:]  # repeats: the drafter finds windows to verify


async def _run(chain, prompt: list[int], n: int, sampling: Sampling, session: str) -> list[int]:
    return [t.token_id async for t in chain.coordinator.generate(prompt, max_tokens=n, sampling=sampling,
                                                                 session=session)]


@pytest.mark.parametrize(("speculate", "sampling"), [
    ("off", Sampling()),
    ("off", Sampling(temperature=0.9, top_k=20, top_p=0.9, seed=7)),
    ("on", Sampling()),
    ("on", Sampling(temperature=0.8, seed=3, presence_penalty=0.5)),
])
@sync
async def test_recomputation_reproduces_the_chain(tiny_model: Path, speculate: str, sampling: Sampling) -> None:
    chain = await make_chain(tiny_model, [0, 2, 4, 6], speculate=speculate)
    recorders = []
    for server in chain.servers[1:]:
        server.recorder = Recorder()
        recorders.append(server.recorder)
    try:
        for k, prompt in enumerate((PROMPT, LOOP)):
            session = f"s{k}"
            tokens = await _run(chain, prompt, 24, sampling, session)
            request = FinishedRequest(session, prompt, tokens, sampling)
            result = recompute(tiny_model, chain.hops, request, chunk=256, context=256)
            assert result.first_bad is None, (tokens, result.expected)
            assert len(result.honest) == 2 and result.ranges == [(0, 2), (2, 4), (4, 6)]
            coordinator = chain.hops[0].node_id
            records = [r.get(session, coordinator) for r in recorders]
            n = len(prompt) + len(tokens) - 1
            for i, record in enumerate(records, start=1):
                assert record is not None and record.complete and record.positions >= n
                assert rows_close(record.rows("inputs")[:n], result.honest[i - 1])
                if i < len(records):
                    assert rows_close(record.rows("outputs")[:n], result.honest[i])
            assert records[-1].tokens[: len(tokens)] == tokens
            assert recorders[0].get(session, "someone-else") is None
    finally:
        await chain.close()


@sync
async def test_a_forged_token_is_found(tiny_model: Path) -> None:
    chain = await make_chain(tiny_model, [0, 3, 6])
    try:
        tokens = await _run(chain, PROMPT, 12, Sampling(), "f")
        forged = [*tokens[:5], (tokens[5] + 1) % 259, *tokens[6:]]
        result = recompute(tiny_model, chain.hops, FinishedRequest("f", PROMPT, forged, Sampling()), chunk=256,
                           context=256)
        assert result.first_bad == 5 and result.expected == tokens[5]
    finally:
        await chain.close()


@sync
async def test_range_by_range_within_a_small_memory_bound(tiny_model: Path) -> None:
    """A request whose recomputation does not fit the bound at once runs one layer at a time, same result."""
    chain = await make_chain(tiny_model, [0, 3, 6], max_context=512)
    try:
        prompt = list(np.random.default_rng(1).integers(1, 250, 300))  # two prefill chunks
        tokens = await _run(chain, prompt, 16, Sampling(), "long")
        request = FinishedRequest("long", prompt, tokens, Sampling())
        whole = recompute(tiny_model, chain.hops, request, chunk=256, context=512)
        reader = GGUFFile(tiny_model)
        bound = stage_memory(reader, 0, 1, 512)  # one layer's worth: each range is a single layer
        small = recompute(tiny_model, chain.hops, request, chunk=256, context=512, bound=bound)
        assert whole.ranges == [(0, 3), (3, 6)]
        assert small.ranges == [(i, i + 1) for i in range(6)]
        assert whole.first_bad is small.first_bad is None
        assert all(np.array_equal(a, b) for a, b in zip(whole.honest, small.honest, strict=True))
    finally:
        await chain.close()
