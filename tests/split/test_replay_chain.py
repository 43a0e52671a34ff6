"""SplitEngine rides out a stage failure: it waits for the rebuilt chain and replays the request into it.

Real chains on 127.0.0.1 (one QUIC endpoint per stage, the tiny model); a stage is taken down mid-stream
by closing its endpoint. ``rebuild`` plays placement's part (detach on the failure, attach a new chain
or give up), so each test decides what the rebuilt chain is, or that there is none.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from split_helpers import MODEL, Chain, make_chain

from meshllm.engine.base import CompletionRequest, Finish, GenerationParams, TextDelta
from meshllm.split.engine import NO_CHAIN, ChainUnavailable, SplitEngine
from meshllm.split.errors import StageFailed

REQUEST = CompletionRequest(model=MODEL, prompt="Hello", params=GenerationParams(temperature=0.0, max_tokens=120))
SEEDED = CompletionRequest(model=MODEL, prompt="Hello",
                           params=GenerationParams(temperature=0.9, seed=1234, max_tokens=120))
CUT = 30
"""Deltas read before the middle stage goes down."""


async def run(engine: SplitEngine, break_stage: Callable[[], Any] | None,
              request: CompletionRequest = REQUEST) -> tuple[str, Finish]:
    text, n = "", 0
    async for event in engine.generate(request):
        if isinstance(event, Finish):
            return text, event
        assert isinstance(event, TextDelta)
        text, n = text + event.text, n + 1
        if n == CUT and break_stage is not None:
            await break_stage()
    raise AssertionError("no finish")


async def setup(tiny_model: Path, events: list[tuple[str, dict[str, Any]]], rebuild: Callable[[StageFailed], None],
                **engine_kwargs: Any) -> tuple[SplitEngine, Chain]:
    engine = SplitEngine(tiny_model, MODEL, 256, on_event=lambda kind, **f: events.append((kind, f)), **engine_kwargs)
    await engine.load()
    chain = await make_chain(tiny_model, [0, 2, 4, 6], on_stage_failed=rebuild)
    engine.attach(chain.coordinator)
    return engine, chain


def stop_middle(chain: Chain) -> Callable[[], Any]:
    async def stop() -> None:
        chain.servers[1].close()
        await chain.endpoints[1].close()
    return stop


@pytest.mark.parametrize("request_", [REQUEST, SEEDED], ids=["greedy", "seeded"])
def test_a_stream_continues_exactly_on_the_rebuilt_chain(tiny_model: Path, request_: CompletionRequest) -> None:
    """Seeded: the rebuilt chain's last stage starts at draw ``k`` of the seeded stream (``k`` tokens
    already generated), so the sampled text is the uninterrupted one."""

    async def main() -> None:
        events: list[tuple[str, dict[str, Any]]] = []
        spare: list[Chain] = []

        def rebuild(exc: StageFailed) -> None:  # placement: detach now, attach a 2-stage chain a moment later
            engine.detach(f"stage {exc.stage_index} failed; replanning the chain")
            asyncio.get_running_loop().call_later(0.05, lambda: engine.attach(spare[0].coordinator))

        engine, chain = await setup(tiny_model, events, rebuild)
        spare.append(await make_chain(tiny_model, [0, 3, 6]))
        try:
            reference = await run(engine, None, request_)
            assert len(reference[0]) > CUT and reference[1].usage.completion_tokens == 120
            assert await run(engine, stop_middle(chain), request_) == reference
            kinds = [k for k, _ in events]
            assert kinds == ["split_replay", "split_replayed"]
            replay, replayed = events[0][1], events[1][1]
            assert replay["stage"] == 1 and replay["failed_node"] == chain.hops[1].node_id
            assert replayed["stages"] == 2 and CUT <= replayed["tokens"] < 120 and replayed["took_ms"] >= 40
            assert 0 < replayed["passes"] < replayed["tokens"]  # the failed chain's passes, re-run
            assert (engine.replays, engine.replays_failed) == (1, 0)
        finally:
            await engine.close()
            for c in (chain, *spare):
                await c.close()

    asyncio.run(main())


@pytest.mark.parametrize("case", ["placement gives up", "no chain in time", "replays off"])
def test_without_a_rebuilt_chain_the_request_ends_naming_the_stage(tiny_model: Path, case: str) -> None:
    async def main() -> None:
        events: list[tuple[str, dict[str, Any]]] = []

        def rebuild(exc: StageFailed) -> None:
            engine.detach(f"stage {exc.stage_index} failed; replanning the chain")
            if case == "placement gives up":
                asyncio.get_running_loop().call_later(
                    0.05, lambda: engine.detach(f"{NO_CHAIN}: a split needs at least one live worker"))

        kwargs = {"replay_wait_s": 0.5} if case == "no chain in time" else \
            {"max_replays": 0} if case == "replays off" else {}
        engine, chain = await setup(tiny_model, events, rebuild, **kwargs)
        killed = 0.0

        async def stop() -> None:
            nonlocal killed
            killed = time.monotonic()
            await stop_middle(chain)()

        try:
            with pytest.raises(ChainUnavailable) as caught:
                await run(engine, stop)
            took = time.monotonic() - killed
            message = str(caught.value)
            assert "split stage 1 on node" in message and took < 2.0, (message, took)
            if case == "placement gives up":
                assert "cannot be rebuilt" in message and "live worker" in message
                assert [k for k, _ in events] == ["split_replay", "split_replay_failed"]
            elif case == "no chain in time":
                assert "no new chain within 0.5s" in message and took >= 0.5
                assert engine.replays_failed == 1
            else:
                assert events == [] and engine.replays == 0
        finally:
            await engine.close()
            await chain.close()

    asyncio.run(main())
