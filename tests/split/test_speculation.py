"""Speculative decoding on split chains over real QUIC endpoints: same greedy tokens, KV cut on every stage.

The tiny random model's greedy text soon falls into loops with breaks in between, so prompt-lookup
drafts are often right and sometimes wrong: a long run exercises kept and rejected windows. Every
comparison is token by token against plain decoding of the whole model in one stage.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from net.net_helpers import until
from split_helpers import MODEL, make_chain, solo_greedy

from meshllm.split import Sampling, SplitCoordinator
from meshllm.split.frames import MAX_DRAFT, Tokens

PROMPT = [1, *b"the cat sat on the mat. the cat sat on the mat. the cat"]
N = 150


@pytest.mark.parametrize(("bounds", "mode"), [([0, 3, 6], "on"), ([0, 2, 4, 6], "on"), ([0, 2, 4, 6], "auto")])
def test_greedy_tokens_with_speculation_are_plain_decodings(tiny_model: Path, bounds: list[int], mode: str) -> None:
    async def main() -> tuple[list[int], dict]:
        chain = await make_chain(tiny_model, bounds, speculate=mode)
        try:
            out = [t.token_id async for t in chain.coordinator.generate(PROMPT, max_tokens=N)]
            return out, chain.coordinator.speculation_status()
        finally:
            await chain.close()

    tokens, stats = asyncio.run(main())
    assert tokens == solo_greedy(tiny_model, PROMPT, N)
    if mode == "on":  # every draft found is verified: windows were kept and rejected along the way
        assert stats["verify_passes"] > 10 and 0 < stats["accepted"] < stats["drafted"]
        assert stats["passes"] < N - 10 and stats["tokens_per_pass"] > 1.0


def test_every_stage_holds_exactly_the_kept_positions(tiny_model: Path) -> None:
    """At each reply, the last stage holds exactly the kept length and every other stage has cut the
    previous window's rejected positions before running this step's (their lengths agree and stay
    within this step's window); a stage that had kept stale positions would refuse the step outright."""
    seen: list[tuple[int, list[int]]] = []

    async def main() -> list[int]:
        chain = await make_chain(tiny_model, [0, 2, 4, 6], speculate="on")
        stages = [chain.coordinator.first] + [s.core.hosted[(None, MODEL)].stage for s in chain.servers[1:]]
        server = chain.servers[0]
        route = server.route_replies

        def watching(session: str, sink):  # type: ignore[no-untyped-def]
            def observe(peer: str, frame: object) -> None:
                if isinstance(frame, Tokens):
                    seen.append((frame.pos - len(frame.token_ids), [s.session_length(session) for s in stages]))
                    assert stages[-1].session_length(session) == frame.pos
                sink(peer, frame)
            return route(session, observe)

        server.route_replies = watching  # type: ignore[method-assign]
        try:
            out = [t.token_id async for t in chain.coordinator.generate(PROMPT, max_tokens=N, session="kv")]
            await until(lambda: all(s.session_length("kv") == 0 for s in stages))  # the Stop freed every stage
            return out
        finally:
            await chain.close()

    assert asyncio.run(main()) == solo_greedy(tiny_model, PROMPT, N)
    windows = 0
    for start, lengths in seen[1:]:  # (the first reply is the prefill's)
        *upstream, _ = lengths
        assert len(set(upstream)) == 1 and start < upstream[0] <= start + MAX_DRAFT + 1
        windows += upstream[0] > start + 1
    assert windows > 10


def test_seeded_sampling_with_speculation_gives_the_plain_text(tiny_model: Path) -> None:
    """The acceptance rule is coupled to the plain draw: same seed, same tokens, whatever the windows were."""
    sampling = Sampling(temperature=0.8, top_k=40, seed=11)

    async def run(mode: str) -> tuple[list[int], dict]:
        chain = await make_chain(tiny_model, [0, 3, 6], speculate=mode)
        coord: SplitCoordinator = chain.coordinator
        try:
            return [t.token_id async for t in coord.generate(PROMPT, max_tokens=100, sampling=sampling)], \
                coord.speculation_status()
        finally:
            await chain.close()

    plain, _ = asyncio.run(run("off"))
    spec, stats = asyncio.run(run("on"))
    assert spec == plain and len(plain) == 100
    assert stats["drafted"] > 0 and stats["accepted"] > 0
