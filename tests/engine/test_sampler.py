"""Sampler properties: greedy is argmax, seeds reproduce, truncations restrict the support."""

from __future__ import annotations

import numpy as np
import pytest

from meshllm.engine.base import SamplingParams
from meshllm.engine.sampler import PENALTY_WINDOW, Sampler, step_uniform

LOGITS = np.random.default_rng(7).normal(0, 3, 1000).astype(np.float32)
ORDER = np.argsort(-LOGITS)


def _draws(params: SamplingParams, n: int = 400, logits: np.ndarray = LOGITS) -> set[int]:
    sampler = Sampler(params)
    return {sampler(logits) for _ in range(n)}


def test_greedy_is_argmax() -> None:
    assert _draws(SamplingParams(temperature=0.0), n=5) == {int(np.argmax(LOGITS))}


def test_same_seed_same_tokens_and_other_seed_differs() -> None:
    def run(seed: int) -> list[int]:
        sampler = Sampler(SamplingParams(temperature=1.5, seed=seed))
        return [sampler(LOGITS) for _ in range(50)]

    assert run(3) == run(3)
    assert run(3) != run(4)


def test_top_k_restricts_support() -> None:
    drawn = _draws(SamplingParams(temperature=5.0, top_k=5, seed=1))
    assert drawn <= set(ORDER[:5].tolist()) and len(drawn) == 5


def test_top_p_keeps_the_smallest_prefix_reaching_p() -> None:
    probs = np.exp(LOGITS - LOGITS.max())
    probs /= probs.sum()
    cumulative = np.cumsum(probs[ORDER])
    n = int(np.searchsorted(cumulative, 0.8)) + 1
    drawn = _draws(SamplingParams(temperature=1.0, top_p=0.8, seed=2), n=2000)
    assert drawn <= set(ORDER[:n].tolist())
    assert len(drawn) > 1


def test_min_p_drops_unlikely_tokens() -> None:
    probs = np.exp(LOGITS - LOGITS.max())
    allowed = set(np.flatnonzero(probs >= 0.2).tolist())
    drawn = _draws(SamplingParams(temperature=3.0, min_p=0.2, seed=3))
    assert drawn <= allowed and len(allowed) > 1


def test_low_temperature_approaches_greedy() -> None:
    assert _draws(SamplingParams(temperature=1e-3, seed=4), n=50) == {int(np.argmax(LOGITS))}


def test_repetition_penalty_steers_away_from_recent_tokens() -> None:
    logits = np.array([2.0, 1.9, -1.0, -1.1], np.float32)
    greedy = SamplingParams(temperature=0.0, repeat_penalty=1.5)
    assert Sampler(greedy)(logits, history=[0]) == 1  # 2.0 / 1.5 < 1.9
    assert Sampler(greedy)(logits, history=[0, 1]) == 0  # both penalized: 1.33 vs 1.27
    assert Sampler(greedy)(np.array([-1.0, -1.2]), history=[0]) == 1  # negative logits are multiplied


@pytest.mark.parametrize(("presence", "frequency"), [(1.0, 0.0), (0.0, 0.5)])
def test_presence_and_frequency_penalties(presence: float, frequency: float) -> None:
    logits = np.array([1.0, 0.5], np.float32)
    sampler = Sampler(SamplingParams(temperature=0.0, presence_penalty=presence, frequency_penalty=frequency))
    assert sampler(logits, history=[0, 0]) == 1
    assert sampler(logits, history=[1]) == 0


def test_penalties_only_look_at_the_recent_window() -> None:
    logits = np.array([2.0, 1.9, 0.0], np.float32)
    sampler = Sampler(SamplingParams(temperature=0.0, repeat_penalty=2.0))
    assert sampler(logits, history=[0] + [2] * PENALTY_WINDOW) == 0  # token 0 is out of the window
    assert sampler(logits, history=[0] + [2] * (PENALTY_WINDOW - 1)) == 1


def test_fast_paths_equal_the_whole_vocabulary_computations() -> None:
    """Top-k from a strided bound, top-p from a shortlist and the block-wise draw match the plain ones."""
    from meshllm.engine.sampler import _candidates, _draw, _top_p

    rng = np.random.default_rng(11)
    for logits in (rng.normal(0, 3, 262_144).astype(np.float32), rng.normal(0, 0.01, 100_000).astype(np.float32)):
        for k in (1, 40, 3000):
            assert set(_candidates(logits, k).tolist()) == set(np.argpartition(-logits, k - 1)[:k].tolist())
        probs = np.exp(logits.astype(np.float64) - logits.max())
        probs /= probs.sum()
        order = np.argsort(-probs, kind="stable")
        for top_p in (0.05, 0.5, 0.95):
            n = int(np.searchsorted(np.cumsum(probs[order]), top_p)) + 1
            assert set(np.flatnonzero(_top_p(probs, top_p)).tolist()) == set(order[:n].tolist())
    weights = np.zeros(5000, np.float32)
    weights[[3, 1500, 4999]] = [1.0, 2.0, 1.0]
    drawn = np.bincount([_draw(weights, u) for u in rng.random(8000)], minlength=5000)
    assert set(np.flatnonzero(drawn).tolist()) == {3, 1500, 4999}  # never a zero-weight token
    assert abs(drawn[1500] / 8000 - 0.5) < 0.03
    assert _draw(weights, 1.0 - 1e-16) == 4999  # the very end: the last token with weight


def test_draw_k_depends_only_on_seed_and_k() -> None:
    """A sampler started at step k (a request resumed after k tokens) draws what one that drew the
    first k itself draws next, whatever logits those first k draws saw."""
    params = SamplingParams(temperature=1.2, top_k=50, seed=9)
    whole = Sampler(params)
    first = [whole(np.roll(LOGITS, i)) for i in range(10)]
    rest = [whole(LOGITS) for _ in range(20)]
    resumed = Sampler(params, step=10)
    assert [resumed(LOGITS) for _ in range(20)] == rest and len(set(first + rest)) > 1
    assert whole.step == 30 and 0.0 <= step_uniform(9, 0) < 1.0 != step_uniform(9, 1)
