"""A split replay on the default model (SmolLM2-135M) continues with exactly the uninterrupted text.

SmolLM2's logits differ between a one-row decode step and a multi-row prefill of the same tokens
(ggml's attention takes another kernel for one query row than for several: up to 0.7 in a logit,
docs/architecture.md), so a rebuilt chain that prefilled the generated tokens left the greedy text
a few tokens after the cut. The rebuilt chain re-runs the failed chain's passes with their rows
(:class:`~meshllm.split.coordinator.Replay`) and gives the uninterrupted text; with the re-run
turned off (``replay_passes_s=0``: the prefill) it does not.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from split_helpers import MODEL, Chain, make_chain

from meshllm.engine.base import CompletionRequest, Finish, GenerationParams, TextDelta
from meshllm.models.bundled import bundled_model_path
from meshllm.split import Deadlines
from meshllm.split.engine import SplitEngine
from meshllm.split.errors import StageFailed

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

REQUEST = CompletionRequest(model=MODEL, prompt="The history of the city of Paris",
                            params=GenerationParams(temperature=0.0, max_tokens=48))
CUT = 12
"""Deltas read before the middle stage goes down."""
LENIENT = {"probe_interval": 0.25, "deadlines": Deadlines(decode_timeout=10.0)}
"""The only stage failure here is the one the test makes (a closed endpoint is noticed at once): on a
loaded host, the suite's quick probes and the 1 s decode deadline made the reference stream fail over
too, and its replay (at 0 tokens) was the one the test then read."""


async def stream(engine: SplitEngine, chain: Chain | None) -> str:
    text, n = "", 0
    async for event in engine.generate(REQUEST):
        if isinstance(event, Finish):
            assert event.usage.completion_tokens == 48
            return text
        assert isinstance(event, TextDelta)
        text, n = text + event.text, n + 1
        if n == CUT and chain is not None:
            chain.servers[1].close()
            await chain.endpoints[1].close()
    raise AssertionError("no finish")


@pytest.mark.parametrize("passes_s", [2.0, 0.0], ids=["passes", "prefill"])
def test_a_replay_on_smollm2_gives_the_uninterrupted_text(passes_s: float) -> None:
    path = bundled_model_path("smollm2")

    async def main() -> tuple[str, str, list[tuple[str, dict[str, Any]]]]:
        events: list[tuple[str, dict[str, Any]]] = []
        spare: list[Chain] = []

        def rebuild(exc: StageFailed) -> None:  # placement: detach now, attach a 2-stage chain a moment later
            engine.detach(f"stage {exc.stage_index} failed; replanning the chain")
            asyncio.get_running_loop().call_later(0.05, lambda: engine.attach(spare[0].coordinator))

        engine = SplitEngine(path, MODEL, 256, replay_passes_s=passes_s,
                             on_event=lambda kind, **f: events.append((kind, f)))
        await engine.load()
        chain = await make_chain(path, [0, 10, 20, 30], on_stage_failed=rebuild, **LENIENT)
        spare.append(await make_chain(path, [0, 15, 30], **LENIENT))
        engine.attach(chain.coordinator)
        try:
            reference = await stream(engine, None)
            replayed = await stream(engine, chain)
        finally:
            await engine.close()
            for c in (chain, *spare):
                await c.close()
        return reference, replayed, events

    reference, replayed, events = asyncio.run(main())
    assert [kind for kind, _ in events] == ["split_replay", "split_replayed"]
    assert CUT <= events[0][1]["tokens"] < 48
    assert (events[1][1]["passes"] > 0) == (passes_s > 0)  # (the prefill's token is not a pass)
    if passes_s:
        assert replayed == reference
    else:  # the prefill of the generated tokens: SmolLM2's text leaves the uninterrupted one (why passes are re-run)
        assert replayed != reference
