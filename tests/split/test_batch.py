"""Batching on split chains over real QUIC endpoints: concurrent requests share decode passes, and
each one's text is byte for byte what it is alone.

Every comparison runs the same requests one at a time on the same kind of chain first: that is the
reference (a lone session's steps are single rows; in a pass they sit beside other sessions' rows).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from pathlib import Path

import anyio
import pytest
from net.net_helpers import until
from split_helpers import MODEL, PROMPT, make_chain, solo_greedy

from meshllm.engine.ggml import StageModel
from meshllm.split import Sampling, SplitCoordinator, StageFailed
from meshllm.split.engine import SplitEngine
from meshllm.split.frames import Batch, Decode, Verify

LOOPY = [1, *b"the cat sat on the mat. the cat sat on the mat. the cat"]
REQUESTS: list[tuple[list[int], int, Sampling]] = [
    (PROMPT, 40, Sampling()),
    ([1, *b"Once upon a time"], 33, Sampling()),
    (LOOPY, 45, Sampling()),
    ([1, *b"abc"], 25, Sampling(temperature=0.8, top_k=40, seed=7)),
    ([1, *b"A much longer prompt, so that its prefill takes a while beside the others"], 38,
     Sampling(temperature=1.1, top_p=0.9, seed=3)),
]
"""Greedy and seeded requests of different lengths: sessions join and leave the batch at different times."""


async def _run(coord: SplitCoordinator, prompt: list[int], n: int, sampling: Sampling,
               stop_after: int | None = None, session: str | None = None) -> list[int]:
    out = []
    async for t in coord.generate(prompt, max_tokens=n, sampling=sampling, session=session):
        out.append(t.token_id)
        if stop_after is not None and len(out) == stop_after:
            break  # the client goes away: the session leaves the batch
    return out


def _record_logits(stage: StageModel) -> list[dict[tuple[str, int], bytes]]:
    """Keep the bytes of every decode row's logits on the last stage, by (session, position), in the
    last dict of the returned list (append one to start another record)."""
    real = stage.forward_batch
    records: list[dict[tuple[str, int], bytes]] = [{}]

    def forward_batch(steps, **kw):  # type: ignore[no-untyped-def]
        outs = real(steps, **kw)
        for (session, _, pos), out in zip(steps, outs, strict=True):
            records[-1][(session, pos)] = out.tobytes()
        return outs

    stage.forward_batch = forward_batch  # type: ignore[method-assign]
    return records


def _alone_then_together(path: Path, bounds: list[int], **kwargs: object) -> tuple[list[list[int]], list[list[int]],
                                                                                  SplitCoordinator]:
    """The requests one at a time, then all at once; the last stage's logits agree bit for bit too."""
    async def main() -> tuple[list[list[int]], list[list[int]], SplitCoordinator]:
        chain = await make_chain(path, bounds, **kwargs)
        coord = chain.coordinator
        logits = _record_logits(chain.servers[-1].core.hosted[(None, MODEL)].stage)
        try:
            alone = [await _run(coord, *r, session=f"r{i}") for i, r in enumerate(REQUESTS)]
            passes, steps = coord.batcher.plan.passes, coord.batcher.plan.steps
            assert steps == passes  # one at a time: every pass held one session
            logits.append({})
            together = await asyncio.gather(*(_run(coord, *r, session=f"r{i}") for i, r in enumerate(REQUESTS)))
            coord.batcher.plan.passes -= passes
            coord.batcher.plan.steps -= steps
            assert len(logits[0]) > 150 and logits[1] == logits[0]
            return alone, list(together), coord
        finally:
            await chain.close()

    return asyncio.run(main())


@pytest.mark.parametrize("bounds", [[0, 3, 6], [0, 2, 4, 6]])
def test_concurrent_requests_give_the_text_they_give_alone(tiny_model: Path, bounds: list[int]) -> None:
    alone, together, coord = _alone_then_together(tiny_model, bounds, speculate="off")
    assert together == alone
    assert [len(t) for t in together] == [n for _, n, _ in REQUESTS]
    assert coord.batcher.plan.steps / coord.batcher.plan.passes > 1.3  # the passes really were shared
    assert alone[0] == solo_greedy(tiny_model, PROMPT, 40)  # and a lone session is the whole model's text


def test_one_at_a_time_baseline_gives_the_same_text(tiny_model: Path) -> None:
    """``batch=1`` (``--split-batch 1``): concurrent requests take turns, one session per pass."""
    alone, together, coord = _alone_then_together(tiny_model, [0, 3, 6], speculate="off", batch=1)
    assert together == alone and coord.batcher.plan.steps == coord.batcher.plan.passes


def test_a_cancelled_request_leaves_the_others_text_unchanged(tiny_model: Path) -> None:
    async def main() -> tuple[list[list[int]], list[list[int]], int]:
        chain = await make_chain(tiny_model, [0, 2, 4, 6], speculate="off")
        coord = chain.coordinator
        try:
            alone = [await _run(coord, *r) for r in REQUESTS]
            cut = [None, 5, None, 1, None]
            together = await asyncio.gather(*(_run(coord, *r, stop_after=c) for r, c in zip(REQUESTS, cut,
                                                                                              strict=True)))
            await until(lambda: sum(s.sessions for s in chain.servers[1:]) == 0)
            return alone, list(together), sum(s.sessions for s in chain.servers[1:])
        finally:
            await chain.close()

    alone, together, left = asyncio.run(main())
    assert together[1] == alone[1][:5] and together[3] == alone[3][:1]
    assert [together[i] for i in (0, 2, 4)] == [alone[i] for i in (0, 2, 4)]
    assert left == 0  # every session's Stop freed its KV on every stage


def test_batches_with_speculation_stay_exact(tiny_model: Path) -> None:
    """Verify windows ride in the same pass as other sessions' Decodes; every text is the plain one."""
    sent: list[object] = []

    async def main() -> tuple[list[list[int]], list[list[int]]]:
        plain = await make_chain(tiny_model, [0, 3, 6], speculate="off")
        try:
            reference = [await _run(plain.coordinator, *r) for r in REQUESTS]
        finally:
            await plain.close()
        chain = await make_chain(tiny_model, [0, 3, 6], speculate="on")
        lane = await chain.servers[0].pool.get(chain.hops[1].node_id, chain.hops[1].addr)
        real_send = lane.send

        async def record(frame):  # type: ignore[no-untyped-def]
            sent.append(frame)
            await real_send(frame)

        lane.send = record  # type: ignore[method-assign]
        try:
            together = await asyncio.gather(*(_run(chain.coordinator, *r) for r in REQUESTS))
            return reference, list(together)
        finally:
            await chain.close()

    reference, together = asyncio.run(main())
    assert together == reference
    mixed = [f for f in sent if isinstance(f, Batch) and {type(s) for s in f.steps} == {Decode, Verify}]
    assert len(mixed) > 3  # windows and plain rows in one pass, many times


def test_a_failed_stage_fails_every_session_of_the_batch_named(tiny_model: Path) -> None:
    async def main() -> tuple[list[BaseException | list[int]], float, str]:
        chain = await make_chain(tiny_model, [0, 2, 4, 6], speculate="off")
        coord = chain.coordinator
        closed_at = 0.0
        streaming: set[int] = set()

        async def run(i: int) -> list[int]:
            nonlocal closed_at
            out = []
            async for t in coord.generate([1, *b"request", i], max_tokens=500):
                out.append(t.token_id)
                if len(out) == 10:
                    streaming.add(i)
                # once all four are in the batch, the middle stage goes, its server first as a stopping node's
                # does (an endpoint closed under a live server can still report its next hop lost first)
                if len(streaming) == 4 and not closed_at:
                    closed_at = time.monotonic()
                    chain.servers[1].close()
                    await chain.endpoints[1].close()
            return out

        try:
            results = await asyncio.gather(*(run(i) for i in range(4)), return_exceptions=True)
            return list(results), time.monotonic() - closed_at, chain.hops[1].node_id
        finally:
            await chain.close()

    results, elapsed, node = asyncio.run(main())
    assert all(isinstance(r, StageFailed) and r.stage_index == 1 and r.node_id == node for r in results), results
    assert elapsed < 2.0


def test_the_split_engine_reports_the_chains_batch_as_its_slots(tiny_model: Path) -> None:
    """Routing reads a split model's concurrency from its load report (gossiped as the record's slots)."""
    async def main() -> list[tuple[int, int]]:
        engine = SplitEngine(tiny_model, "tiny", 256)
        seen = [(engine.load_report().slots, engine.load_report().running)]
        chain = await make_chain(tiny_model, [0, 3, 6], batch=4)
        try:
            engine.attach(chain.coordinator)
            seen.append((engine.load_report().slots, engine.load_report().running))
        finally:
            engine.detach("test over")
            await chain.close()
        return seen

    assert asyncio.run(main()) == [(0, 0), (4, 0)]


def test_a_request_cancelled_at_any_moment_leaves_the_others_exact(tiny_model: Path) -> None:
    """The client's task is cancelled wherever it is (waiting for its pass, its reply, or the first stage):
    the session leaves, its KV is freed, and the other sessions' passes go on unchanged."""
    async def main() -> tuple[list[list[int]], list[list[list[int]]], int]:
        chain = await make_chain(tiny_model, [0, 3, 6], speculate="off")
        coord = chain.coordinator
        try:
            alone = [await _run(coord, *r) for r in REQUESTS]
            runs = []
            for delay in (0.0, 0.003, 0.01, 0.03, 0.07):
                tasks = [asyncio.create_task(_run(coord, *r)) for r in REQUESTS]
                await asyncio.sleep(delay)
                tasks[2].cancel()
                done = await asyncio.gather(*tasks, return_exceptions=True)
                assert isinstance(done[2], asyncio.CancelledError) or done[2] == alone[2]
                runs.append([d for i, d in enumerate(done) if i != 2])
            await until(lambda: sum(s.sessions for s in chain.servers[1:]) == 0)
            return alone, runs, sum(s.sessions for s in chain.servers[1:])
        finally:
            await chain.close()

    alone, runs, left = asyncio.run(main())
    for others in runs:
        assert others == [a for i, a in enumerate(alone) if i != 2]
    assert left == 0


@pytest.mark.parametrize("cancel", ["task", "anyio-scope"])
def test_a_request_cancelled_while_its_pass_is_computed_leaves_the_pass_to_the_others(tiny_model: Path,
                                                                                      cancel: str) -> None:
    """The race the timed cancellations above only hit sometimes, forced: the client goes away while the
    first stage computes the pass holding its step. The pass goes down the chain without that step, and
    the session's Stop follows it (a Stop first made stage 1 refuse the whole pass, failing the others).

    ``anyio-scope`` cancels the way Starlette does when an HTTP client disconnects: the scope cancels
    every await until the task leaves it, the cleanup's own awaits included; nothing may be left behind.
    """
    async def main() -> tuple[list[list[int]], list[object], int, int, list[object]]:
        chain = await make_chain(tiny_model, [0, 3, 6], speculate="off")
        coord, loop = chain.coordinator, asyncio.get_running_loop()
        try:
            alone = [await _run(coord, *r) for r in REQUESTS]
            stop_victim: list[Callable[[], object]] = []
            real, hits = coord.first.forward_batch, []

            def forward_batch(steps, **kw):  # type: ignore[no-untyped-def]
                victim = next((s for s, x, _ in steps if s == "r2" and len(x) == 1), None)
                if victim is not None and len(steps) > 1 and not hits:
                    hits.append(len(steps))
                    loop.call_soon_threadsafe(stop_victim[0])
                    time.sleep(0.3)  # the loop runs the cancelled request's cleanup meanwhile
                return real(steps, **kw)

            async def victim() -> list[int]:
                if cancel == "task":
                    task = asyncio.create_task(_run(coord, *REQUESTS[2], session="r2"))
                    stop_victim.append(task.cancel)
                    return await task
                async with anyio.create_task_group() as group:
                    stop_victim.append(group.cancel_scope.cancel)
                    group.start_soon(_run, coord, *REQUESTS[2], None, "r2")
                raise asyncio.CancelledError  # (the scope swallowed it: report it the same way)

            coord.first.forward_batch = forward_batch  # type: ignore[method-assign]
            tasks = [asyncio.create_task(_run(coord, *r, session=f"r{i}")) if i != 2 else asyncio.create_task(victim())
                     for i, r in enumerate(REQUESTS)]
            done = await asyncio.gather(*tasks, return_exceptions=True)
            await until(lambda: sum(s.sessions for s in chain.servers[1:]) == 0)
            leftovers = [coord.first.session_length("r2"), "r2" in coord.server._replies]
            return alone, list(done), len(hits), sum(s.sessions for s in chain.servers[1:]), leftovers
        finally:
            await chain.close()

    alone, done, hit, left, leftovers = asyncio.run(main())
    assert hit == 1  # the cancellation did land inside a pass's compute
    assert isinstance(done[2], asyncio.CancelledError)
    assert [d for i, d in enumerate(done) if i != 2] == [a for i, a in enumerate(alone) if i != 2]
    assert left == 0 and leftovers == [0, False]  # no KV on any stage, no reply routing left


def test_a_prompt_cancelled_mid_chunk_frees_its_kv_without_stalling_the_loop(tiny_model: Path) -> None:
    """A client that goes away while the first stage computes its prompt chunk (in a worker thread): the
    chunk runs to its end, and the session's KV is freed after it through the node's compute runner,
    not on the event loop, which would block until the chunk let go of the stage (lanes, probes and the
    API stall meanwhile, and peers may take the node for dead)."""
    async def main() -> tuple[list[str], int, int]:
        chain = await make_chain(tiny_model, [0, 3, 6], speculate="off")
        coord, loop = chain.coordinator, asyncio.get_running_loop()
        order: list[str] = []
        real_forward, real_reset = coord.first.forward, coord.first.reset
        task: asyncio.Task[list[int]] | None = None

        def forward(session, inputs, pos, **kw):  # type: ignore[no-untyped-def]
            if session == "victim" and not order:
                order.append("chunk")
                assert task is not None
                loop.call_soon_threadsafe(task.cancel)
                time.sleep(1.0)
                order.append("chunk done")
            return real_forward(session, inputs, pos, **kw)

        def reset(session: str) -> None:
            if session == "victim":
                order.append("reset")
            real_reset(session)

        coord.first.forward, coord.first.reset = forward, reset  # type: ignore[method-assign]
        ticks = 0

        async def ticker() -> None:
            nonlocal ticks
            while True:
                await asyncio.sleep(0.01)
                ticks += 1

        clock = asyncio.create_task(ticker())
        try:
            task = asyncio.create_task(_run(coord, *REQUESTS[4], session="victim"))
            with pytest.raises(asyncio.CancelledError):
                await task
            await until(lambda: "reset" in order, timeout=5)
            return order, ticks, coord.first.session_length("victim")
        finally:
            clock.cancel()
            await chain.close()

    order, ticks, kv = asyncio.run(main())
    assert order == ["chunk", "chunk done", "reset"] and kv == 0
    assert ticks >= 30  # the loop ran on during the chunk's second (a blocked loop ticks about once)


def test_a_lane_lost_under_a_pass_fails_only_its_own_sessions(tiny_model: Path) -> None:
    """Sessions on two lanes to stage 1 (the pool replaced the first one's lane) share a pass; the older
    lane closes while the pass is computed. Its session fails, naming stage 1; the others' frame goes on
    their own lane and their text is what it is alone."""
    async def main() -> tuple[list[list[int]], list[object], int]:
        chain = await make_chain(tiny_model, [0, 3, 6], speculate="off")
        coord, loop = chain.coordinator, asyncio.get_running_loop()
        hop = coord.chain[1].node_id
        try:
            alone = [await _run(coord, *r) for r in REQUESTS[1:4]]
            real, hits = coord.first.forward_batch, []
            old: list[object] = []

            def forward_batch(steps, **kw):  # type: ignore[no-untyped-def]
                if "old" in {s for s, _, _ in steps} and len(steps) > 1 and not hits:
                    hits.append(1)
                    loop.call_soon_threadsafe(old[0].close, "test: lane lost")  # type: ignore[attr-defined]
                    time.sleep(0.1)
                return real(steps, **kw)

            coord.first.forward_batch = forward_batch  # type: ignore[method-assign]
            first = asyncio.create_task(_run(coord, *REQUESTS[0], session="old"))
            await until(lambda: len(coord.batcher.plan.decoding) == 1)
            old.append(coord.server.pool._lanes.pop(hop))  # the next sessions dial a lane of their own
            others = [asyncio.create_task(_run(coord, *r, session=f"new{i}")) for i, r in enumerate(REQUESTS[1:4])]
            done = await asyncio.gather(first, *others, return_exceptions=True)
            return alone, list(done), len(hits)
        finally:
            await chain.close()

    alone, done, hit = asyncio.run(main())
    assert hit == 1  # the old lane's session did share a pass with the new lane's
    assert isinstance(done[0], StageFailed) and done[0].stage_index == 1, done[0]
    assert done[1:] == alone
