"""2- and 3-stage chains over real QUIC endpoints produce the solo runtime's tokens."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from split_helpers import PROMPT, make_chain, solo_greedy

N = 12


@pytest.mark.parametrize("bounds", [[0, 3, 6], [0, 2, 4, 6], [0, 1, 5, 6]])
def test_greedy_tokens_match_solo(tiny_model: Path, bounds: list[int]) -> None:
    async def main() -> list[int]:
        chain = await make_chain(tiny_model, bounds)
        try:
            return [t.token_id async for t in chain.coordinator.generate(PROMPT, max_tokens=N)]
        finally:
            await chain.close()

    assert asyncio.run(main()) == solo_greedy(tiny_model, PROMPT, N)
