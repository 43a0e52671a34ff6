"""Per-session KV caches: independent sessions, reset, trim, position checks, context limit."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from stage_helpers import PROMPT

from meshllm.engine.numpy.errors import StageInputError
from meshllm.engine.numpy.stage import StageModel


@pytest.fixture
def stage(tiny_gemma3: Path) -> StageModel:
    return StageModel.load(tiny_gemma3, max_context=40)


def test_sessions_are_independent(stage: StageModel) -> None:
    a = stage.forward("a", np.array(PROMPT[:10]), 0)
    stage.forward("b", np.array(PROMPT[10:20]), 0)
    assert stage.session_length("a") == 10 and stage.session_length("b") == 10
    stage.reset("a")
    assert np.array_equal(stage.forward("a", np.array(PROMPT[:10]), 0), a)


def test_reset_forgets_everything(stage: StageModel) -> None:
    first = stage.forward("s", np.array(PROMPT[:8]), 0)
    stage.forward("s", np.array(PROMPT[8:12]), 8)
    stage.reset("s")
    assert stage.session_length("s") == 0
    assert np.array_equal(stage.forward("s", np.array(PROMPT[:8]), 0), first)


def test_trim_then_refeed_gives_the_same_logits(stage: StageModel) -> None:
    full = stage.forward("s", np.array(PROMPT[:20]), 0)
    stage.trim("s", 12)
    assert stage.session_length("s") == 12
    again = stage.forward("s", np.array(PROMPT[12:20]), 12)
    assert np.allclose(again, full[12:], rtol=0, atol=1e-5)
    stage.trim("s", 12)
    other = stage.forward("s", np.array([40]), 12)  # a different continuation after the same prefix
    stage.reset("s")
    fresh = stage.forward("s", np.array([*PROMPT[:12], 40]), 0)
    assert np.allclose(other[-1], fresh[-1], rtol=0, atol=1e-5)


def test_cache_grows_past_its_initial_capacity(tiny_llama: Path) -> None:
    stage = StageModel.load(tiny_llama, max_context=600)
    tokens = np.random.default_rng(0).integers(3, 259, 600)
    whole = stage.forward("a", tokens, 0)
    for start in range(0, 600, 100):  # crosses the 256 and 512 token reallocations
        part = stage.forward("b", tokens[start : start + 100], start)
        assert np.allclose(part, whole[start : start + 100], rtol=0, atol=1e-4)


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
