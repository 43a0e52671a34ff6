"""Speculative decoding on the llama engine: windows in the step's batch change no token.

A tiny llama with Q8_0 weights (quantized weights compute a row alike in any batch, so the load
probe finds windows exact): the same request with ``speculate`` off and on/auto gives the same
tokens, greedy and seeded, alone and beside other streams, over long runs whose windows are often
rejected, and each slot's KV holds exactly the tokens it kept. A float32 model, whose windows the
probe finds inexact, does not speculate and says why.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import gguf
import pytest
from test_llama_batching import collect, one, req
from tinymodels import write_tiny_llama

from meshllm.engine.llama import LlamaEngine

REPETITIVE = "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\n" * 4
STREAMS = [f"Stream {i}: the river runs to the sea and the sea runs to the river. " * (1 + i % 2) for i in range(4)]


@pytest.fixture(scope="module")
def q8_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_llama(tmp_path_factory.mktemp("m") / "tiny-q8.gguf", seed=2,
                            weight_type=gguf.GGMLQuantizationType.Q8_0)


@pytest.fixture(scope="module")
def engines(q8_model: Path) -> Iterator[dict[str, LlamaEngine]]:
    made = {mode: LlamaEngine(q8_model, n_ctx=1024, n_threads=1, parallel=4, speculate=mode)  # type: ignore[arg-type]
            for mode in ("off", "on", "auto")}
    for engine in made.values():
        asyncio.run(engine.load())
    yield made
    for engine in made.values():
        asyncio.run(engine.close())


def kv_matches_cache(engine: LlamaEngine) -> bool:
    """Every slot's KV holds exactly the tokens its scheduler says it holds: no rejected position is left."""
    assert engine._sched is not None and engine._ctx is not None
    return all(engine._ctx.length(s.index) == len(s.cached) for s in engine._sched.slots)


def test_the_probe_finds_windows_exact_and_speculation_verifies_them(engines: dict[str, LlamaEngine]) -> None:
    for mode, engine in engines.items():
        assert engine.unavailable is None and engine.speculate == mode
    on = engines["on"]
    before = on.spec.verify_passes
    one(on, req(REPETITIVE, 64))
    status = on.speculation_status()
    assert on.spec.verify_passes > before and status["tokens_per_pass"] > 1.0  # type: ignore[operator]
    assert status["mode"] == "on" and status["unavailable"] is None and status["call_ms_by_rows"]


def test_greedy_text_with_speculation_is_the_text_without(engines: dict[str, LlamaEngine]) -> None:
    for prompt in (REPETITIVE, STREAMS[0], "x"):
        plain = one(engines["off"], req(prompt, 96, logprobs=2))
        for mode in ("on", "auto"):
            got = one(engines[mode], req(prompt, 96, logprobs=2))
            assert got[:2] == plain[:2], (mode, prompt)
            assert got[2].usage.completion_tokens == plain[2].usage.completion_tokens
            assert got[2].reason == plain[2].reason


def test_seeded_sampling_with_speculation_is_the_text_without(engines: dict[str, LlamaEngine]) -> None:
    """The coupled rule: each position samples the draw plain decoding makes at that step."""
    for seed, params in ((5, {"temperature": 0.7}), (6, {"temperature": 1.0, "top_k": 20, "top_p": 0.9}),
                         (7, {"temperature": 0.8, "presence_penalty": 0.5, "frequency_penalty": 0.3})):
        plain = one(engines["off"], req(REPETITIVE, 96, seed=seed, **params))
        assert one(engines["on"], req(REPETITIVE, 96, seed=seed, **params))[:2] == plain[:2], params
    assert one(engines["on"], req(REPETITIVE, 96, seed=8, temperature=0.7))[1] != plain[1]


def test_concurrent_streams_with_speculation_are_each_their_text_alone(engines: dict[str, LlamaEngine]) -> None:
    expected = [one(engines["off"], req(p, 120)) for p in STREAMS]
    on = engines["on"]
    calls, rows, verified = on.stats.decode_calls, on.stats.decode_rows, on.spec.verify_passes

    async def together() -> list[tuple[str, list[int], object]]:
        return await asyncio.gather(*(collect(on, req(p, 120)) for p in STREAMS))  # type: ignore[arg-type]

    results = asyncio.run(together())
    assert [r[:2] for r in results] == [e[:2] for e in expected]
    assert (on.stats.decode_rows - rows) / (on.stats.decode_calls - calls) > 1.5  # the streams shared calls
    assert on.spec.verify_passes - verified > 10
    assert kv_matches_cache(on)


def test_rejected_windows_leave_the_kv_consistent_over_a_long_run(engines: dict[str, LlamaEngine]) -> None:
    """700 tokens token by token against plain decoding, with many windows rejected part way."""
    prompt = "one two three four five six seven eight nine ten. " * 3
    plain = one(engines["off"], req(prompt, 700))
    on = engines["on"]
    drafted, accepted = on.spec.drafted, on.spec.accepted
    got = one(on, req(prompt, 700))
    assert len(plain[1]) == 700
    first_difference = next((i for i, (a, b) in enumerate(zip(got[1], plain[1], strict=True)) if a != b), None)
    assert first_difference is None and got[0] == plain[0]
    kept, rejected = on.spec.accepted - accepted, (on.spec.drafted - drafted) - (on.spec.accepted - accepted)
    # the windows' sizes follow measured call costs, so how many drafts fail varies with the host's load
    # (20-40 rejected on a quiet host, fewer under load): what counts is that some were, part way
    assert kept > 50 and rejected >= 1, (kept, rejected)
    assert kv_matches_cache(on)
    # and the slot's cache still serves the next request exactly (its KV is what its tokens say)
    assert one(on, req(prompt, 64))[:2] == one(engines["off"], req(prompt, 64))[:2]


def test_windows_respect_max_tokens_and_stops(engines: dict[str, LlamaEngine]) -> None:
    for max_tokens in (1, 2, 5, 17):
        plain = one(engines["off"], req(REPETITIVE, max_tokens))
        got = one(engines["on"], req(REPETITIVE, max_tokens))
        assert got[:2] == plain[:2] and got[2].usage.completion_tokens == len(plain[1]) <= max_tokens
    text = one(engines["off"], req(REPETITIVE, 64))[0]
    stop = text[20:24]
    plain = one(engines["off"], req(REPETITIVE, 64, stop=[stop]))
    got = one(engines["on"], req(REPETITIVE, 64, stop=[stop]))
    assert got[:2] == plain[:2] and got[2].reason == plain[2].reason == "stop"
    assert kv_matches_cache(engines["on"])


def test_float_weights_do_not_speculate_and_say_why(tmp_path: Path) -> None:
    engine = LlamaEngine(write_tiny_llama(tmp_path / "f32.gguf", seed=2), n_ctx=512, n_threads=1, parallel=2,
                         speculate="on")
    asyncio.run(engine.load())
    try:
        assert engine.unavailable is not None and engine.speculate == "off"
        one(engine, req(REPETITIVE, 48))
        status = engine.speculation_status()
        assert status["mode"] == "off" and status["verify_passes"] == 0 and "window" in str(status["unavailable"])
    finally:
        asyncio.run(engine.close())


CODE = ("Rename the variable total to amount in this function:\n\ndef invoice_total(items):\n    total = 0\n"
        "    for item in items:\n        total += item.price * item.quantity\n    return total\n\n"
        "Here is the function with total renamed to amount:\n\ndef invoice_total(items):\n")


@pytest.mark.slow
def test_default_model_speculation_changes_no_token(gemma_model: Path) -> None:
    """The default model: softmax attention computes a window's rows unlike single rows there (heads
    share keys), so the probe turns speculation off and ``on`` gives exactly the plain text; the
    engine keeps softmax attention, the stage runtime's, rather than switch kernels for drafts."""
    made = {mode: LlamaEngine(gemma_model, n_ctx=1024, n_threads=1, parallel=2, speculate=mode)  # type: ignore[arg-type]
            for mode in ("off", "on")}
    try:
        for engine in made.values():
            asyncio.run(engine.load())
        assert made["on"].unavailable is not None and made["on"].speculation_status()["unavailable"]
        # a window the probe let through would show in verify_passes: short runs suffice
        for request in (req(CODE, 32), req(CODE, 24, temperature=0.8, seed=3)):
            assert one(made["on"], request)[:2] == one(made["off"], request)[:2]
        assert made["on"].spec.verify_passes == 0
    finally:
        for engine in made.values():
            asyncio.run(engine.close())
