"""Batch frames from a peer are validated before anything reaches ggml; a bad one is refused whole,
with an Error for every session it names, and changes nothing (over a real lane; the stage core's
checks in memory are in tests/split/test_stage_core.py)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
from split_helpers import MODEL, PROMPT, addr, endpoint, make_chain, solo_greedy

from meshllm.split import Hop, StageServer, codec
from meshllm.split.frames import Batch, Decode, Error, Open, Prefill


def test_bad_batches_from_a_peer_fail_only_their_sessions(tiny_model: Path) -> None:
    """Over a real lane: refused batches answer with Errors for their sessions; the stage's other
    sessions, and the chain's own requests, go on untouched."""

    async def main() -> tuple[list[int], dict[str, list[str]]]:
        chain = await make_chain(tiny_model, [0, 3, 6])
        ep = await endpoint(probe_interval=0.1)
        server = StageServer(ep)
        errors: dict[str, list[str]] = {s: [] for s in ("p", "q", "r")}
        for sid, codes in errors.items():
            server.route_replies(sid, lambda _p, f, codes=codes: codes.append(f.code) if isinstance(f, Error) else None)
        hops = [Hop(ep.node_id, addr(ep), 0, 3), chain.hops[1]]

        async def inject() -> None:
            lane = await server.pool.get(chain.hops[1].node_id, chain.hops[1].addr)
            for sid in ("p", "q"):
                await lane.send(Open(session=sid, model=MODEL, layer_start=3, layer_end=6, chain=hops, index=1))
            x = codec.encode(np.ones((2, 64), np.float32), "f32")
            for sid in ("p", "q"):
                await lane.send(Prefill(session=sid, pos=0, n_tokens=2, dtype="f32", shape=(2, 64), activations=x))
            one = codec.encode(np.ones((1, 64), np.float32), "f32")
            bad_pos = Decode(session="q", pos=9, n_tokens=1, dtype="f32", shape=(1, 64), activations=one)
            good = Decode(session="p", pos=2, n_tokens=1, dtype="f32", shape=(1, 64), activations=one)
            await lane.send(Batch(steps=[good, bad_pos]))  # refused whole: p and q each get an Error
            nan = codec.encode(np.full((1, 64), np.nan, np.float32), "f32")
            await lane.send(Batch(steps=[Decode(session="r", pos=0, n_tokens=1, dtype="f32", shape=(1, 64),
                                                activations=nan)]))  # never opened here

        try:
            tokens, _ = await asyncio.gather(
                _generate(chain), inject())
            await asyncio.sleep(0.2)
            return tokens, errors
        finally:
            server.close()
            await ep.close()
            await chain.close()

    async def _generate(chain) -> list[int]:  # type: ignore[no-untyped-def]
        return [t.token_id async for t in chain.coordinator.generate(PROMPT, max_tokens=20)]

    tokens, errors = asyncio.run(main())
    assert tokens == solo_greedy(tiny_model, PROMPT, 20)
    # the Prefills were answered with Tokens (not routed to Error lists); the batch was refused for both
    assert errors["p"] == ["out-of-order"] and errors["q"] == ["out-of-order"] and errors["r"] == ["not-in-plan"]
