"""Sampler properties: greedy is argmax, seeds reproduce, truncations restrict the support."""

from __future__ import annotations

import numpy as np
import pytest

from meshllm.engine.sampler import Sampler, SamplingParams

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
    logits = np.array([2.0, 1.9], np.float32)
    sampler = Sampler(SamplingParams(temperature=0.0, repeat_penalty=2.0, repeat_last_n=2))
    assert sampler(logits, history=[0, 1, 1]) == 0
