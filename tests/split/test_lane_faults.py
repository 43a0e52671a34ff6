"""Lane faults: bad frames fail only their session, and a lost stage fails the request fast, named."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

import numpy as np
from split_helpers import MODEL, PROMPT, addr, endpoint, make_chain, solo_greedy

from meshllm.engine.ggml import StageModel
from meshllm.split import Hop, SplitCoordinator, StageFailed, StageServer, codec
from meshllm.split.frames import Decode, Error, Open, Prefill

N = 24


def test_bad_frames_fail_only_their_session(tiny_model: Path) -> None:
    """Out-of-order, malformed, oversized and outside-the-plan frames share a lane with a healthy session."""

    async def main() -> tuple[list[int], list[int], dict[str, list[str]]]:
        chain = await make_chain(tiny_model, [0, 3, 6])
        chain.servers[1].max_activation_bytes = 4096  # applies to lanes opened from now on
        ep = await endpoint(probe_interval=0.1)
        server = StageServer(ep)
        other = SplitCoordinator(
            server, MODEL, StageModel.load(tiny_model, 0, 3, max_context=256),
            [Hop(ep.node_id, addr(ep), 0, 3), chain.hops[1]],
        )
        errors: dict[str, list[str]] = {"bad1": [], "bad2": [], "main": []}
        for sid, codes in errors.items():
            server.route_replies(sid, lambda _p, f, codes=codes: codes.append(f.code) if isinstance(f, Error) else None)

        async def inject() -> None:
            lane = await server.pool.get(chain.hops[1].node_id, chain.hops[1].addr)
            x = np.ones((1, 64), np.float32)
            one = {"n_tokens": 1, "dtype": "f32", "shape": (1, 64), "activations": codec.encode(x, "f32")}
            hops = [Hop(ep.node_id, addr(ep), 0, 3), chain.hops[1]]
            await lane.send(Open(session="bad1", model=MODEL, layer_start=3, layer_end=6, chain=hops, index=1))
            await lane.send(Prefill(session="bad1", pos=5, **one))  # type: ignore[arg-type]
            await lane.stream.send({"type": "decode", "session": "bad2", "pos": "x"})
            big = np.ones((40, 64), np.float32)
            await lane.send(Prefill(session="main", pos=0, n_tokens=40, dtype="f32", shape=(40, 64),
                                    activations=codec.encode(big, "f32")))
            await lane.send(Decode(session="main", pos=len(PROMPT), **one))  # type: ignore[arg-type]

        async def run(coord: SplitCoordinator, session: str) -> list[int]:
            return [t.token_id async for t in coord.generate(PROMPT, max_tokens=N, session=session)]

        try:
            ours, theirs, _ = await asyncio.gather(run(other, "healthy"), run(chain.coordinator, "main"), inject())
            await asyncio.sleep(0.1)
            return ours, theirs, errors
        finally:
            server.close()
            await ep.close()
            await chain.close()

    ours, theirs, errors = asyncio.run(main())
    expected = solo_greedy(tiny_model, PROMPT, N)
    assert ours == expected and theirs == expected
    assert errors == {"bad1": ["out-of-order"], "bad2": ["bad-frame"], "main": ["too-large", "not-in-plan"]}


def test_closing_a_middle_stage_fails_the_request_fast_and_names_it(tiny_model: Path) -> None:
    async def main() -> tuple[StageFailed, float, list[StageFailed], str]:
        reported: list[StageFailed] = []
        chain = await make_chain(tiny_model, [0, 2, 4, 6], on_stage_failed=reported.append)
        killed_at = 0.0
        try:
            async for token in chain.coordinator.generate(PROMPT, max_tokens=200):
                if not killed_at and token.token_id is not None:
                    await asyncio.sleep(0.05)
                    killed_at = time.monotonic()
                    await chain.endpoints[1].close()
        except StageFailed as exc:
            return exc, time.monotonic() - killed_at, reported, chain.hops[1].node_id
        finally:
            await chain.close()
        raise AssertionError("the request survived a dead stage")

    exc, elapsed, reported, node = asyncio.run(main())
    assert exc.stage_index == 1 and exc.node_id == node
    assert elapsed < 1.0
    assert reported == [exc]


def test_stall_is_diagnosed_by_position(tiny_model: Path) -> None:
    """A stage that stops computing (alive, but stuck) is named from its pong's position."""

    async def main() -> StageFailed:
        from meshllm.split import Deadlines

        chain = await make_chain(tiny_model, [0, 2, 4, 6], deadlines=Deadlines(decode_timeout=0.3))
        release = threading.Event()
        try:
            stuck = chain.servers[2]
            async for _ in chain.coordinator.generate(PROMPT, max_tokens=200):
                if not stuck.compute.queued and not stuck.compute.busy:  # the third stage never computes again
                    stuck.compute.submit("stuck", lambda: release.wait(30.0))  # (it holds the device to the end)
        except StageFailed as exc:
            return exc
        finally:
            release.set()
            await chain.close()
        raise AssertionError("the request survived a stuck stage")

    exc = asyncio.run(main())
    assert exc.stage_index == 2 and "stalled" in exc.reason


def test_a_slow_stage_that_answers_and_moves_is_waited_for(tiny_model: Path) -> None:
    """A stage held for 1.2 deadlines once (a first pass building graphs, a loaded host) answers its pings:
    the request gets another deadline and gives the solo text; before, the stage was named stalled
    and evicted (a CI split lost its only worker so)."""

    async def main() -> list[int]:
        from meshllm.split import Deadlines

        chain = await make_chain(tiny_model, [0, 2, 4, 6], deadlines=Deadlines(decode_timeout=0.5))
        try:
            slow, held, out = chain.servers[2], False, []
            async for token in chain.coordinator.generate(PROMPT, max_tokens=N):
                out.append(token.token_id)
                if not held:
                    held = True
                    slow.compute.submit("held", lambda: time.sleep(0.6))
            return out
        finally:
            await chain.close()

    assert asyncio.run(main()) == solo_greedy(tiny_model, PROMPT, N)


def test_int8_and_f16_lanes(tiny_model: Path) -> None:
    async def main(dtype: str) -> list[int]:
        chain = await make_chain(tiny_model, [0, 3, 6])
        try:
            gen = chain.coordinator.generate(PROMPT, max_tokens=N, dtype=dtype)  # type: ignore[arg-type]
            return [t.token_id async for t in gen]
        finally:
            await chain.close()

    expected = solo_greedy(tiny_model, PROMPT, N)
    assert asyncio.run(main("f16")) == expected
    assert len(asyncio.run(main("i8"))) == N


def test_int8_hand_over_keeps_logits_close(tiny_model: Path) -> None:
    whole = StageModel.load(tiny_model)
    a, b = StageModel.load(tiny_model, 0, 3), StageModel.load(tiny_model, 3, 6)
    ids = np.asarray(PROMPT)
    ref = whole.forward("s", ids, 0)
    x = a.forward("s", ids, 0)
    for dtype, tol in (("f32", 0.0), ("f16", 0.01), ("i8", 0.05)):
        b.reset("s")
        got = b.forward("s", codec.decode(codec.encode(x, dtype), dtype, *x.shape), 0)
        rel = np.abs(got - ref).max() / np.abs(ref).max()
        assert rel <= tol, (dtype, rel)
        assert dtype == "i8" or (got.argmax(axis=1) == ref.argmax(axis=1)).all()
