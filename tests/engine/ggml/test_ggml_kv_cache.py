"""Per-session KV caches: independent sessions, reset, trim, growth, position checks, context limit.

Also the three uses the stage API is shaped for: logits for several positions at once (a speculative
verify window) followed by ``trim`` of the rejected ones, and the replay of a prompt plus generated
tokens into a fresh session (a rebuilt chain) giving the same next-token logits.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from stage_helpers import PROMPT

from meshllm.engine.ggml.errors import StageInputError
from meshllm.engine.ggml.stage import StageModel


@pytest.fixture
def stage(tiny_gemma3: Path) -> Iterator[StageModel]:
    s = StageModel.load(tiny_gemma3, max_context=40, threads=1)
    yield s
    s.close()


def test_sessions_are_independent(stage: StageModel) -> None:
    a = stage.forward("a", np.array(PROMPT[:10]), 0)
    stage.forward("b", np.array(PROMPT[10:20]), 0)
    assert stage.session_length("a") == 10 and stage.session_length("b") == 10
    stage.reset("a")
    assert np.array_equal(stage.forward("a", np.array(PROMPT[:10]), 0), a)


def test_interleaved_sessions_match_separate_runs(stage: StageModel) -> None:
    """Decoding two sessions in turns (each with its own kept graph) equals running each alone, bit for bit."""
    def decode(session: str, prompt: list[int], tokens: list[int]) -> list[np.ndarray]:
        stage.forward(session, np.array(prompt), 0)
        return [stage.forward(session, np.array([t]), p) for p, t in enumerate(tokens, start=len(prompt))]

    alone_p = decode("x", PROMPT[:6], PROMPT[6:12])
    alone_q = decode("y", PROMPT[20:26], PROMPT[26:32])
    stage.forward("p", np.array(PROMPT[:6]), 0)
    stage.forward("q", np.array(PROMPT[20:26]), 0)
    mixed_p, mixed_q = [], []
    for i in range(6):
        mixed_p.append(stage.forward("p", np.array([PROMPT[6 + i]]), 6 + i))
        mixed_q.append(stage.forward("q", np.array([PROMPT[26 + i]]), 6 + i))
    assert all(np.array_equal(a, b) for a, b in zip(alone_p + alone_q, mixed_p + mixed_q, strict=True))


def test_reset_forgets_everything(stage: StageModel) -> None:
    first = stage.forward("s", np.array(PROMPT[:8]), 0)
    stage.forward("s", np.array(PROMPT[8:12]), 8)
    stage.reset("s")
    assert stage.session_length("s") == 0
    assert np.array_equal(stage.forward("s", np.array(PROMPT[:8]), 0), first)


def _close(a: np.ndarray, b: np.ndarray) -> bool:
    """Equal up to the f16 cache and the batch shape (different kernels for 1 and n rows)."""
    return bool(np.allclose(a, b, rtol=0, atol=2e-3 * np.abs(b).max()))


def test_verify_window_then_trim_the_rejected(stage: StageModel) -> None:
    """Four draft tokens in one call give four rows of logits; trimming two continues as if they never came."""
    afters = []
    for rejected in ([PROMPT[14], PROMPT[15]], [200, 201]):
        stage.forward("s", np.array(PROMPT[:12]), 0)
        window = stage.forward("s", np.array([*PROMPT[12:14], *rejected]), 12)
        assert window.shape == (4, 259)
        stage.trim("s", 14)  # accept two, reject two
        assert stage.session_length("s") == 14
        afters.append(stage.forward("s", np.array([77]), 14))
        stage.reset("s")
    assert np.array_equal(afters[0], afters[1])  # the rejected rows are never read again
    fresh = stage.forward("s", np.array([*PROMPT[:14], 77]), 0)
    assert _close(afters[0][-1], fresh[-1]) and _close(window[:2], fresh[12:14])


def test_replay_into_a_fresh_session_continues_the_same(stage: StageModel) -> None:
    """A prompt prefilled then decoded, replayed as one call in a new session, gives the same next logits."""
    stage.forward("old", np.array(PROMPT[:10]), 0)
    for pos, t in enumerate(PROMPT[10:14], start=10):
        stage.forward("old", np.array([t]), pos)
    nxt = stage.forward("old", np.array(PROMPT[14:15]), 14)
    replayed = stage.forward("new", np.array(PROMPT[:15]), 0, last_only=True)
    assert _close(nxt, replayed)
    assert int(np.argmax(nxt)) == int(np.argmax(replayed))


def test_cache_grows_past_its_first_capacity(tiny_llama: Path) -> None:
    stage = StageModel.load(tiny_llama, max_context=1100, threads=1)
    tokens = np.random.default_rng(0).integers(3, 259, 1100)
    whole = stage.forward("a", tokens, 0)  # three chunks of at most 512 tokens
    assert stage.session_length("a") == 1100
    for start in range(0, 1100, 100):  # crosses the 256, 512 and 1024 row reallocations
        part = stage.forward("b", tokens[start : start + 100], start)
        assert _close(part, whole[start : start + 100])
    assert stage.memory()["kv"] == 2 * 4 * 2 * 32 * 2 * 1280  # two sessions x 4 layers x K,V x 32 x f16 x rows
    stage.close()


def test_wrong_position_is_refused_and_changes_nothing(stage: StageModel) -> None:
    stage.forward("s", np.array(PROMPT[:5]), 0)
    with pytest.raises(StageInputError, match="position 5"):
        stage.forward("s", np.array([7]), 4)
    assert stage.session_length("s") == 5


def test_context_limit(stage: StageModel) -> None:
    stage.forward("s", np.array(PROMPT[:30]), 0)
    with pytest.raises(StageInputError, match="context full"):
        stage.forward("s", np.array(PROMPT[:11]), 30)
    assert stage.session_length("s") == 30
    stage.forward("s", np.array(PROMPT[:10]), 30)  # exactly up to the limit is fine
    assert stage.session_length("s") == 40


def test_trim_bounds(stage: StageModel) -> None:
    stage.forward("s", np.array(PROMPT[:5]), 0)
    with pytest.raises(StageInputError):
        stage.trim("s", 6)
    with pytest.raises(StageInputError):
        stage.trim("unknown", 3)
    stage.trim("unknown", 0)


def test_reset_frees_the_cache(stage: StageModel) -> None:
    stage.forward("s", np.array(PROMPT[:5]), 0)
    assert stage.memory()["kv"] > 0
    stage.reset("s")
    assert stage.memory()["kv"] == 0
