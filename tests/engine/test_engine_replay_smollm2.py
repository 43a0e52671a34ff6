"""A whole-model replay on the default model (SmolLM2-135M) continues with exactly the uninterrupted text.

A replay (a routed request whose serving node died mid-answer, ``runtime/replay.py``) reaches an engine
as the request plus the token ids already sent (``continuation``). SmolLM2's logits differ between a
one-row decode step and a multi-row prefill of the same tokens (ggml's attention takes another kernel
for one query row than for several: docs/architecture.md), so an engine that prefilled prompt +
continuation left the greedy text a few tokens after the cut. Both engines compute the continuation
as it was first computed, one row per step (the llama engine while other requests share its batches)
while that is predicted to take at most ``replay_steps_s``; with 0 they prefill it with the prompt,
and the text leaves the uninterrupted one (why the steps are re-run).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest

from meshllm.engine.base import REPLAY_STEPS_S, CompletionRequest, Engine, Finish, GenerationParams, TextDelta
from meshllm.engine.ggml.engine import GgmlEngine
from meshllm.engine.llama import LlamaEngine
from meshllm.models.bundled import bundled_model_path

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

PROMPT = "The history of the city of Paris"
TOKENS = 48
CUT = 12
"""Tokens sent before the first engine dies: a prefill of them leaves SmolLM2's text at token 19 (0-based),
where the uninterrupted run's top two logits are 0.012 apart."""
OTHERS = ("Once upon a time, in a small village,", "The best way to learn Python is",
          "In 1905, Albert Einstein published")


def request(prompt: str = PROMPT, continuation: list[int] | tuple[int, ...] = ()) -> CompletionRequest:
    return CompletionRequest(model="smollm2", prompt=prompt, continuation=tuple(continuation),
                             params=GenerationParams(temperature=0.0, max_tokens=TOKENS))


async def tokens(engine: Engine, req: CompletionRequest) -> list[int]:
    """The ids of the request's deltas (after its continuation); the stream must end with a finish."""
    out: list[int] = []
    async for event in engine.generate(req):
        if isinstance(event, TextDelta):
            out.extend(event.tokens)
        else:
            assert isinstance(event, Finish) and event.usage.completion_tokens == TOKENS
            return out
    raise AssertionError("no finish")


@pytest.fixture(scope="module")
def loop() -> Iterator[asyncio.AbstractEventLoop]:
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


@pytest.fixture(scope="module")
def llama(loop: asyncio.AbstractEventLoop) -> Iterator[LlamaEngine]:
    engine = LlamaEngine(bundled_model_path("smollm2"), model_id="smollm2", n_ctx=1024, n_threads=1, parallel=4)
    loop.run_until_complete(engine.load())
    yield engine
    loop.run_until_complete(engine.close())


@pytest.fixture(scope="module")
def uninterrupted(llama: LlamaEngine, loop: asyncio.AbstractEventLoop) -> list[int]:
    """The greedy tokens of the request, run alone on the llama engine."""
    out = loop.run_until_complete(tokens(llama, request()))
    assert len(out) == TOKENS
    return out


@pytest.mark.parametrize("steps_s", [REPLAY_STEPS_S, 0.0], ids=["steps", "prefill"])
def test_the_llama_engine_replays_exactly_beside_other_requests(
        steps_s: float, llama: LlamaEngine, uninterrupted: list[int], loop: asyncio.AbstractEventLoop) -> None:
    async def main() -> list[list[int]]:
        return list(await asyncio.gather(tokens(llama, request(continuation=uninterrupted[:CUT])),
                                         *(tokens(llama, request(p)) for p in OTHERS)))

    llama.replay_steps_s, headless = steps_s, llama.stats.headless_rows
    try:
        replayed, *_ = loop.run_until_complete(main())
    finally:
        llama.replay_steps_s = REPLAY_STEPS_S
    if steps_s:
        assert llama.stats.headless_rows - headless == CUT - 1  # decode rows (the last sent one samples the next)
        assert uninterrupted[:CUT] + replayed == uninterrupted
    else:  # prefilled with the prompt: SmolLM2's text leaves the uninterrupted one
        assert llama.stats.headless_rows == headless
        assert uninterrupted[:CUT] + replayed != uninterrupted


@pytest.mark.parametrize("steps_s", [REPLAY_STEPS_S, 0.0], ids=["steps", "prefill"])
def test_the_ggml_engine_replays_exactly_by_one_row_steps(
        steps_s: float, uninterrupted: list[int], loop: asyncio.AbstractEventLoop) -> None:
    """The request began on the llama engine (the replay crosses engines: their one-row logits agree)."""
    engine = GgmlEngine(bundled_model_path("smollm2"), model_id="smollm2", n_ctx=1024, threads=1,
                        replay_steps_s=steps_s)
    loop.run_until_complete(engine.load())
    try:
        assert loop.run_until_complete(tokens(engine, request())) == uninterrupted
        replayed = loop.run_until_complete(tokens(engine, request(continuation=uninterrupted[:CUT])))
        rows = engine.replay_rows
    finally:
        loop.run_until_complete(engine.close())
    if steps_s:
        assert rows == CUT - 1  # (the last sent token is the step that samples the next)
        assert uninterrupted[:CUT] + replayed == uninterrupted
    else:  # the prefill of the sent tokens: SmolLM2's text leaves the uninterrupted one
        assert rows == 0
        assert uninterrupted[:CUT] + replayed != uninterrupted
