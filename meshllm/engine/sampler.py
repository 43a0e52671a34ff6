"""Choosing the next token from logits: penalties, greedy, temperature, top-k, top-p, min-p.

The order follows llama.cpp's default chain (penalties, top-k, top-p, min-p, temperature, draw), so
the same parameters mean the same thing on either engine. Randomness comes from a numpy ``Generator``
seeded per request: the same seed, prompt and parameters give the same tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from meshllm.engine.base import GenerationParams


@dataclass(frozen=True)
class SamplingParams:
    """OpenAI-like sampling controls plus llama.cpp's min-p and repetition penalty."""

    temperature: float = 1.0
    """0 (or below) is greedy: always the most likely token."""
    top_k: int = 0
    """Keep only the k most likely tokens; 0 keeps all."""
    top_p: float = 1.0
    """Keep the smallest set of most likely tokens whose probability reaches top_p; 1 keeps all."""
    min_p: float = 0.0
    """Drop tokens less likely than min_p times the most likely one; 0 keeps all."""
    repeat_penalty: float = 1.0
    """Divide positive (multiply negative) logits of recently seen tokens by this; 1 is off."""
    repeat_last_n: int = 64
    """How many of the latest tokens the penalties look at."""
    presence_penalty: float = 0.0
    """OpenAI: subtract this from the logit of every token seen in the window."""
    frequency_penalty: float = 0.0
    """OpenAI: subtract this times the token's count in the window."""
    seed: int | None = None
    """Seed of the random draw; None draws a fresh one."""


def sampling_params(params: GenerationParams) -> SamplingParams:
    """OpenAI semantics for the API's parameters: no min-p and no repetition penalty unless asked."""
    return SamplingParams(
        temperature=params.temperature,
        top_k=params.top_k or 0,
        top_p=params.top_p,
        presence_penalty=params.presence_penalty,
        frequency_penalty=params.frequency_penalty,
        seed=params.seed,
    )


class Sampler:
    """Samples tokens for one request; keep one per request so its random stream is its own."""

    def __init__(self, params: SamplingParams) -> None:
        self.params = params
        self._rng = np.random.default_rng(params.seed)

    def __call__(self, logits: np.ndarray, history: Sequence[int] = ()) -> int:
        """The next token given ``logits`` [vocab] and the tokens so far (for the penalties)."""
        p = self.params
        logits = self._penalized(np.asarray(logits, dtype=np.float32), history)
        if p.temperature <= 0.0:
            return int(np.argmax(logits))
        ids = _candidates(logits, p.top_k)
        z = logits[ids].astype(np.float64)
        z -= z.max()
        probs = np.exp(z)
        probs /= probs.sum()
        keep = np.ones(ids.size, dtype=bool)
        if p.min_p > 0.0:
            keep &= probs >= p.min_p * probs.max()
        if p.top_p < 1.0:
            # the smallest most-likely prefix reaching top_p; sorting only when top-p is asked for
            order = np.argsort(-probs, kind="stable")
            n = int(np.searchsorted(np.cumsum(probs[order]), p.top_p)) + 1
            in_prefix = np.zeros(ids.size, dtype=bool)
            in_prefix[order[:n]] = True
            keep &= in_prefix
        w = np.exp(z[keep] / p.temperature)
        return int(self._rng.choice(ids[keep], p=w / w.sum()))

    def _penalized(self, logits: np.ndarray, history: Sequence[int]) -> np.ndarray:
        """Logits after repetition, presence and frequency penalties over the recent window."""
        p = self.params
        if not history or (p.repeat_penalty == 1.0 and p.presence_penalty == 0.0 and p.frequency_penalty == 0.0):
            return logits
        recent = np.asarray(history[-p.repeat_last_n :] if p.repeat_last_n > 0 else history, dtype=np.int64)
        seen, counts = np.unique(recent, return_counts=True)
        out = logits.copy()
        vals = out[seen]
        vals = np.where(vals > 0, vals / p.repeat_penalty, vals * p.repeat_penalty)
        out[seen] = vals - counts * p.frequency_penalty - p.presence_penalty
        return out


def _candidates(logits: np.ndarray, top_k: int) -> np.ndarray:
    """Token ids still in play after top-k (all of them when top_k is 0 or not smaller than the vocabulary)."""
    if 0 < top_k < logits.size:
        return np.argpartition(-logits, top_k - 1)[:top_k]
    return np.arange(logits.size)
