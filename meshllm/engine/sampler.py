"""Choosing the next token from logits: penalties, grammar, greedy, temperature, top-k, top-p, min-p.

The order follows llama.cpp's default chain (penalties, top-k, top-p, min-p, temperature, draw), so
the same parameters mean the same thing on either engine. The draw of the ``k``-th generated token is
the uniform number :func:`step_uniform` ``(seed, k)``, inverted over the surviving candidates' weights
in token-id order, exactly as :mod:`meshllm.engine.llama_sampling` draws: a seeded request resumed on
another engine or a rebuilt split chain at step ``k`` continues with the tokens the first would have drawn.

A grammar (:class:`meshllm.engine.constrained.Grammar`) is checked the way llama.cpp's server and
our llama.cpp engine check it: the token drawn without it is kept when the grammar allows it (one
token to check), and only otherwise is the whole vocabulary masked and the draw made again with
the same uniform number. The log-probabilities an engine reports are the raw logits' softmax
(:func:`token_logprobs`), as the llama.cpp engine reports them.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import numpy as np

from meshllm.engine.base import GenerationParams, InvalidRequest, SamplingParams, TokenLogprob, TopLogprob

if TYPE_CHECKING:
    from meshllm.engine.constrained import Grammar

MAX_LOGPROBS = 20
"""Most alternatives per token a request may ask for (OpenAI's ``top_logprobs`` limit)."""


PENALTY_WINDOW = 64
"""Tokens the repetition/presence/frequency penalties look back over (both engines)."""
_MASK = (1 << 64) - 1


def step_uniform(seed: int, step: int) -> float:
    """The uniform number in [0, 1) of draw ``step`` (SplitMix64 of ``(seed, step)``): a function of
    both alone, so whichever engine or chain draws step ``k`` of a seeded request draws the same."""
    x = ((seed & _MASK) * 0x9E3779B97F4A7C15 + (step & _MASK) * 0xD1B54A32D192ED03 + 0x632BE59BD9B4E019) & _MASK
    for shift, mult in ((30, 0xBF58476D1CE4E5B9), (27, 0x94D049BB133111EB)):
        x = ((x ^ (x >> shift)) * mult) & _MASK
    x ^= x >> 31
    return (x >> 11) / float(1 << 53)


def request_seed(params: SamplingParams) -> int:
    """The request's seed, or a fresh random one when it has none."""
    return params.seed if params.seed is not None else int.from_bytes(os.urandom(8), "little")


def check_sampling(params: SamplingParams) -> None:
    """Refuse values the penalties cannot use (the API bounds every field; a peer's request is
    checked again here, so a bad value is a clear error rather than a division by zero)."""
    if not (math.isfinite(params.min_p) and 0.0 <= params.min_p <= 1.0):
        raise InvalidRequest(f"min_p must be between 0 and 1, not {params.min_p}")
    if not (math.isfinite(params.repeat_penalty) and params.repeat_penalty > 0.0):
        raise InvalidRequest(f"repeat_penalty must be a positive number, not {params.repeat_penalty}")


class Sampler:
    """Samples tokens for one request; keep one per request so its random stream is its own.

    With a ``grammar``, every token it returns is taken as generated: the grammar advances over it
    (so a caller never feeds the grammar itself, and a rejected draft never reaches it).
    """

    def __init__(self, params: SamplingParams, grammar: Grammar | None = None, *, step: int = 0) -> None:
        """``step``: the index of the first token this sampler draws (the tokens a request already
        generated elsewhere), so its draws continue that request's stream."""
        check_sampling(params)
        self.params = params
        self.grammar = grammar
        self.seed = request_seed(params)
        self.step = step
        """The index of the next draw: every call (and :meth:`judge`) takes draw ``step`` and moves on."""
        self._top_k = params.top_k or 0

    def _uniform(self) -> float:
        u = step_uniform(self.seed, self.step)
        self.step += 1
        return u

    def __call__(self, logits: np.ndarray, history: Sequence[int] = ()) -> int | None:
        """The next token given ``logits`` [vocab] and the tokens so far (for the penalties).

        ``None`` only under a grammar that allows no token at all (the constrained text is complete).
        Sampling runs on every generated token, so it avoids whole-vocabulary sorts and cumulative
        sums (each several milliseconds over Gemma's 262,144 tokens, as long as a decode step):
        top-p sorts only the tokens that can be in its set, and the draw inverts block sums.
        """
        logits = self._penalized(np.asarray(logits, dtype=np.float32), history)
        u = self._uniform()
        if self.params.temperature <= 0.0:
            u = 0.0
        token: int | None = self._pick(logits, u)
        grammar = self.grammar
        if grammar is not None:
            if not grammar.allows(token):
                masked = grammar.mask(logits)
                token = self._pick(masked, u) if np.isfinite(masked).any() else None
            if token is not None:
                grammar.accept(token)
        return token

    def _pick(self, logits: np.ndarray, u: float) -> int:
        """The token the draw ``u`` selects from ``logits`` (at least one finite) under the truncations."""
        p = self.params
        if p.temperature <= 0.0:
            return int(np.argmax(logits))
        ids, w = self._weights(logits)
        pick = _draw(w, u)
        return pick if ids is None else int(ids[pick])

    def judge(self, logits: np.ndarray, history: Sequence[int], token: int, eps: float) -> tuple[bool, int]:
        """Whether ``token`` is what this position gives, within ``eps`` of logit; and what it gives exactly.

        Consumes the position's draw like :meth:`__call__` (an audit replays a request's stream).
        Greedy: ``token``'s logit is within ``eps`` of the largest. Sampled: the draw lands in
        ``token``'s interval of the cumulative weights, widened on each side by the weight a logit
        moved by ``eps`` could shift (``eps / temperature`` of the total, to first order).
        """
        logits = self._penalized(np.asarray(logits, dtype=np.float32), history)
        if not 0 <= token < logits.size:
            return False, self(logits)
        u = self._uniform()
        if self.params.temperature <= 0.0:
            best = int(np.argmax(logits))
            return bool(logits[token] >= logits[best] - eps), best
        ids, w = self._weights(logits)
        pick = _draw(w, u)
        expected = pick if ids is None else int(ids[pick])
        if token == expected:
            return True, expected
        where = np.flatnonzero(ids == token) if ids is not None else np.asarray([token])
        if where.size == 0:
            return False, expected
        i = int(where[0])
        total = float(w.sum(dtype=np.float64))
        lo = float(w[:i].sum(dtype=np.float64))
        slack = total * eps / max(self.params.temperature, 1e-6)
        return bool(lo - slack <= u * total <= lo + float(w[i]) + slack), expected

    def _weights(self, logits: np.ndarray) -> tuple[np.ndarray | None, np.ndarray]:
        """Candidate ids (None: all) and their unnormalised weights after top-k, min-p, top-p, temperature."""
        p = self.params
        ids = _candidates(logits, self._top_k)
        z = logits if ids is None else logits[ids]
        z = z - z.max()
        w = np.exp(z / np.float32(p.temperature))
        if p.min_p > 0.0 or p.top_p < 1.0:
            probs = np.exp(z)
            probs /= probs.sum()
            if p.min_p > 0.0:
                w[probs < p.min_p * probs.max()] = 0.0
            if p.top_p < 1.0:
                w[~_top_p(probs, p.top_p)] = 0.0
        return ids, w

    def _penalized(self, logits: np.ndarray, history: Sequence[int]) -> np.ndarray:
        """Logits after repetition, presence and frequency penalties over the recent window."""
        p = self.params
        if not history or (p.repeat_penalty == 1.0 and p.presence_penalty == 0.0 and p.frequency_penalty == 0.0):
            return logits
        recent = np.asarray(history[-PENALTY_WINDOW:], dtype=np.int64)
        seen, counts = np.unique(recent, return_counts=True)
        out = logits.copy()
        vals = out[seen]
        vals = np.where(vals > 0, vals / p.repeat_penalty, vals * p.repeat_penalty)
        out[seen] = vals - counts * p.frequency_penalty - p.presence_penalty
        return out


def token_logprobs(logits: np.ndarray, token: int, top: int) -> tuple[float, list[tuple[int, float]]]:
    """``token``'s log-probability under the softmax of ``logits`` and the ``top`` most likely tokens
    with theirs (most likely first, ties by id). Computed in float64: the raw model distribution,
    before penalties, grammar and truncations, as OpenAI and the llama.cpp engine report it."""
    z = np.asarray(logits, dtype=np.float64)
    peak = float(z.max())
    lse = peak + float(np.log(np.exp(z - peak).sum()))
    best: list[tuple[int, float]] = []
    if top > 0:
        k = min(top, z.size)
        ids = np.argpartition(-z, k - 1)[:k]
        ids = ids[np.lexsort((ids, -z[ids]))]
        best = [(int(t), float(z[t]) - lse) for t in ids]
    return float(z[token]) - lse, best


def check_logprobs(params: GenerationParams) -> None:
    """Refuse a ``logprobs`` count outside 0-:data:`MAX_LOGPROBS` (a peer can send any number)."""
    if params.logprobs is not None and not 0 <= params.logprobs <= MAX_LOGPROBS:
        raise InvalidRequest(f"logprobs must be between 0 and {MAX_LOGPROBS}")


def logprob_entry(piece: Callable[[int], bytes], token: int, logprob: float,
                  top: Sequence[tuple[int, float]]) -> TokenLogprob:
    """The engine contract's :class:`TokenLogprob` for :func:`token_logprobs`' figures (``piece``: a token's bytes)."""
    return TokenLogprob(token_id=token, piece=piece(token), logprob=logprob,
                        top=tuple(TopLogprob(token_id=t, piece=piece(t), logprob=lp) for t, lp in top))


def _top_p(probs: np.ndarray, top_p: float) -> np.ndarray:
    """Mask of the smallest most-likely set whose probability reaches ``top_p``.

    Tokens less likely than ``(1 - top_p) / n`` together hold less than ``1 - top_p``, so the set
    is reached before any of them: only the others are sorted (a few hundred for a trained model's
    distribution, all of them only for a nearly uniform one).
    """
    n = probs.size
    maybe = np.flatnonzero(probs >= (1.0 - top_p) / n)
    order = maybe[np.argsort(-probs[maybe], kind="stable")]
    count = int(np.searchsorted(np.cumsum(probs[order], dtype=np.float64), top_p)) + 1
    mask = np.zeros(n, dtype=bool)
    mask[order[:count]] = True
    return mask


_BLOCK = 1024


def _draw(w: np.ndarray, u: float) -> int:
    """Index ``i`` with probability ``w[i] / w.sum()`` for a uniform ``u`` in [0, 1) (weights >= 0, not all 0).

    Inverse CDF over block sums, then within one block: one pass over the weights instead of a
    full cumulative sum.
    """
    full = w.size // _BLOCK * _BLOCK
    sums = w[:full].reshape(-1, _BLOCK).sum(axis=1, dtype=np.float64)
    if full < w.size:
        sums = np.append(sums, w[full:].sum(dtype=np.float64))
    cdf = np.cumsum(sums)
    target = u * cdf[-1]
    # the first entry past the target has a positive weight; only rounding can put the target past
    # the end, and then the last positive entry is the one
    b = int(np.searchsorted(cdf, target, side="right"))
    if b >= cdf.size:
        b = int(np.flatnonzero(sums)[-1])
    block = w[b * _BLOCK : (b + 1) * _BLOCK]
    i = int(np.searchsorted(np.cumsum(block, dtype=np.float64), target - (cdf[b - 1] if b else 0.0), side="right"))
    if i >= block.size:
        i = int(np.flatnonzero(block)[-1])
    return b * _BLOCK + i


_STRIDE = 64


def _candidates(logits: np.ndarray, top_k: int) -> np.ndarray | None:
    """Token ids still in play after top-k, ascending (the draw walks candidates in id order, as
    :mod:`meshllm.engine.llama_sampling` does); ``None`` for all of them (top_k 0 or not below the vocabulary).

    The k-th largest of every 64th logit is a lower bound for the k-th largest of all (those k are
    among all), so one comparison leaves a short list to partition instead of the whole vocabulary.
    """
    if not 0 < top_k < logits.size:
        return None
    if logits.size // _STRIDE > top_k:
        bound = np.partition(logits[::_STRIDE], -top_k)[-top_k]
        shortlist = np.flatnonzero(logits >= bound)
        return np.sort(shortlist[np.argpartition(-logits[shortlist], top_k - 1)[:top_k]])
    return np.sort(np.argpartition(-logits, top_k - 1)[:top_k])
