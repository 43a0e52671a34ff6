"""2- and 3-stage chains over real QUIC endpoints produce the solo runtime's tokens."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from split_helpers import PROMPT, make_chain, solo_greedy

from meshllm.split import Deadlines, StageFailed

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


def test_a_stage_unreachable_at_the_start_is_named_and_nothing_is_left_open(tiny_model: Path) -> None:
    """The request connects to every stage at once; the one that cannot be reached fails it, named."""

    async def main() -> tuple[StageFailed, int]:
        chain = await make_chain(tiny_model, [0, 2, 4, 6], deadlines=Deadlines(connect_timeout=0.3))
        await chain.endpoints[2].close()  # stage 2's node is gone before the request starts
        try:
            with pytest.raises(StageFailed) as failed:
                async for _ in chain.coordinator.generate(PROMPT, max_tokens=N):
                    pass
            return failed.value, chain.servers[1].sessions
        finally:
            await chain.close()

    failed, left = asyncio.run(main())
    assert failed.stage_index == 2 and "unreachable" in failed.reason and left == 0
