"""Speculative decoding, sans-IO: draft tokens from n-grams, choose the window, keep the figures.

A decode pass costs far more than its one token where something fixed dominates it: the hops of a
split chain (a 3-stage chain over 40 ms links pays 60 ms per pass whatever it computes), or the pass
over the weights on a local engine. Speculation guesses the next few tokens cheaply, has the model
check them all in one pass, and keeps the longest prefix it agrees with plus the model's own next
token, so one pass yields 1 to k+1 tokens. Drafts come from the text itself (prompt lookup / suffix
matching: code edits, quotes, summaries and loops repeat what is already there), so no draft model
is needed.

* :class:`NgramDrafter` indexes the prompt and every accepted token; :meth:`~NgramDrafter.draft`
  continues the longest recent n-gram that ends the text.
* :class:`WindowPolicy` picks how many drafted tokens the next pass verifies: the ``k`` maximising
  expected tokens per second, ``E(k) / T(k)``, where ``E(k) = 1 + a + ... + a^k`` for the measured
  per-token acceptance ``a`` and ``T(k)`` comes from the caller's measured pass costs. A chain whose
  pass is mostly hop latency gets wide windows; a compute-bound engine narrow ones; drafts the model
  keeps rejecting, none (``auto``).
* :class:`SpecStats` counts passes, drafted and accepted tokens for ``/api/status``.

Verification itself is the engine's: the last stage of a chain (or the local engine) runs the
window's positions, and :meth:`meshllm.engine.sampler.Sampler.verify` applies the acceptance rule
(greedy: exact match; sampled: the standard speculative rule, coupled to the plain draw so that the
text is the one plain decoding samples from the same random stream).
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

SpeculateMode = Literal["off", "on", "auto"]
"""``off``: never; ``auto`` (default): verify drafts only when the measured costs say it pays;
``on``: verify every draft found (the window still adapts its size)."""
MODES: tuple[SpeculateMode, ...] = ("off", "on", "auto")
MAX_WINDOW = 16
"""Most drafted tokens one pass verifies (a window is at most this + 1 positions)."""
AUTO_MARGIN = 0.1
"""Predicted speed-up ``auto`` needs before it verifies drafts."""


class NgramDrafter:
    """Prompt-lookup drafting over one request's tokens (prompt + accepted output).

    Every n-gram of ``min_n .. max_n`` tokens is indexed by where it ends; a draft continues the most
    recent earlier occurrence of the longest n-gram that ends the text. A continuation that runs into
    the end of the text repeats its period (a loop keeps looping), so a draft can be longer than
    the text after the match.
    """

    def __init__(self, tokens: Sequence[int] = (), *, min_n: int = 2, max_n: int = 8) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError("need 1 <= min_n <= max_n")
        self.min_n, self.max_n = min_n, max_n
        self.tokens: list[int] = []
        self._ends: dict[tuple[int, ...], int] = {}
        """n-gram -> end index (exclusive) of its latest occurrence that has a following token."""
        self.extend(tokens)

    def extend(self, tokens: Sequence[int]) -> None:
        """Append accepted tokens (the prompt, then each pass's output)."""
        for token in tokens:
            end = len(self.tokens)  # the n-grams ending here now have a following token
            for n in range(self.min_n, min(self.max_n, end) + 1):
                self._ends[tuple(self.tokens[end - n : end])] = end
            self.tokens.append(int(token))

    def draft(self, k: int) -> list[int]:
        """Up to ``k`` tokens likely to follow the text (empty when no n-gram of it recurs)."""
        toks, length = self.tokens, len(self.tokens)
        if k <= 0:
            return []
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            start = self._ends.get(tuple(toks[length - n :]))
            if start is None or start >= length:
                continue
            period = length - start
            out: list[int] = []
            for i in range(k):
                out.append(toks[start + i] if start + i < length else out[i - period])
            return out
        return []


def expected_tokens(acceptance: float, k: int) -> float:
    """Tokens one pass of ``k`` drafts yields when each is accepted with probability ``acceptance``.

    The accepted prefix has length ``i`` with probability ``a^i (1 - a)`` (``a^k`` for all ``k``),
    and the model adds its own token after it: ``1 + a + a^2 + ... + a^k``.
    """
    a = min(max(acceptance, 0.0), 1.0)
    return float(k + 1) if a >= 1.0 else (1.0 - a ** (k + 1)) / (1.0 - a)


@dataclass
class Acceptance:
    """Per-token acceptance rate, a decaying count of accepted and rejected drafts with a prior.

    A pass that drafted ``k`` tokens and kept ``m`` shows ``m`` acceptances and, if ``m < k``, one
    rejection (the tokens after the first mismatch were never judged). The prior counts as
    ``prior_weight`` judgements, so a handful of passes move the estimate and it forgets old text
    at ``decay`` per pass.
    """

    prior: float = 0.6
    prior_weight: float = 2.0
    decay: float = 0.9
    accepted: float = 0.0
    rejected: float = 0.0

    @property
    def rate(self) -> float:
        w = self.prior_weight
        return (self.accepted + w * self.prior) / (self.accepted + self.rejected + w)

    def observe(self, drafted: int, accepted: int) -> None:
        if drafted <= 0:
            return
        self.accepted = self.accepted * self.decay + accepted
        self.rejected = self.rejected * self.decay + (1.0 if accepted < drafted else 0.0)


PassCost = Callable[[int, float], float]
"""``cost(k, expected_tokens)``: predicted seconds of a pass verifying ``k`` drafts."""


class WindowPolicy:
    """How many drafts the next pass verifies, from the acceptance rate and the caller's pass costs."""

    def __init__(self, mode: SpeculateMode = "auto", max_window: int = MAX_WINDOW, prior: float = 0.6,
                 margin: float = AUTO_MARGIN) -> None:
        if mode not in MODES:
            raise ValueError(f"speculation mode must be one of {', '.join(MODES)}, not {mode!r}")
        self.mode = mode
        self.max_window = max(0, min(max_window, MAX_WINDOW))
        self.acceptance = Acceptance(prior=prior)
        self.margin = margin
        """``auto`` verifies drafts only when they are predicted this much faster than a plain step:
        the costs are averages of noisy measurements, and a wrong guess must not slow text down."""
        self._shadow: tuple[list[int], int] | None = None
        """A declined draft being judged against plain tokens, and how many of it matched so far."""

    def window(self, available: int, cost: PassCost) -> int:
        """Drafts to verify now, out of ``available`` (0: a plain decode step)."""
        top = min(available, self.max_window)
        if self.mode == "off" or top <= 0:
            return 0
        a = self.acceptance.rate
        lowest = 1 if self.mode == "on" else 0
        best_k, best = lowest, -1.0
        for k in range(lowest, top + 1):
            e = expected_tokens(a, k)
            rate = e / max(cost(k, e), 1e-9)
            if rate > best * (1.0 + 1e-6):  # ties keep the smaller window
                best_k, best = k, rate
        if self.mode == "auto" and best_k and best < (1.0 + self.margin) / max(cost(0, 1.0), 1e-9):
            return 0
        return best_k

    def observe(self, drafted: int, accepted: int) -> None:
        """A verified pass: ``accepted`` of its ``drafted`` tokens were kept (ends any pending :meth:`decline`)."""
        self.acceptance.observe(drafted, accepted)
        self._shadow = None

    def decline(self, draft: Sequence[int]) -> None:
        """A draft found but not verified (``auto`` judged it not worth it): judge it for free instead,
        against the tokens plain decoding now produces (:meth:`produced`), so the acceptance rate is
        learnt without paying for it and ``auto`` starts verifying once drafts prove good."""
        if self._shadow is None and draft:
            self._shadow = (list(draft), 0)

    def produced(self, tokens: Sequence[int]) -> None:
        """Tokens a plain step produced: each judges the next token of the pending declined draft."""
        if self._shadow is None:
            return
        draft, kept = self._shadow
        for token in tokens:
            if token != draft[kept]:
                self.acceptance.observe(len(draft), kept)
                self._shadow = None
                return
            kept += 1
            if kept == len(draft):
                self.acceptance.observe(len(draft), kept)
                self._shadow = None
                return
        self._shadow = (draft, kept)


class ChainCosts:
    """Pass costs of a split chain whose last stage stops at the first rejected position.

    ``T(k) = fixed + per_position * (k + 1) + per_token * E(k)``: the hops and protocol (``fixed``)
    are paid once per pass; every stage but the last runs each of the ``k + 1`` positions; the last
    stage runs positions until the first rejection, i.e. as many as tokens come back. Each part is
    the median of the last ``samples`` passes (the stages report their compute times with the
    tokens): on a loaded machine single passes spike, and an average would follow the spikes.
    """

    def __init__(self, samples: int = 32) -> None:
        self._parts: tuple[deque[float], deque[float], deque[float]] = (
            deque(maxlen=samples), deque(maxlen=samples), deque(maxlen=samples))
        self.fixed = self.per_position = self.per_token = 0.0

    @property
    def measured(self) -> bool:
        return bool(self._parts[0])

    def __call__(self, k: int, expected: float) -> float:
        return self.fixed + self.per_position * (k + 1) + self.per_token * expected

    def observe(self, total_s: float, positions: int, tokens: int, upstream_s: float, last_s: float) -> None:
        """A pass that sent ``positions`` and got ``tokens`` back in ``total_s``; ``upstream_s`` is the
        compute of every stage but the last, ``last_s`` the last stage's."""
        parts = (max(total_s - upstream_s - last_s, 0.0), upstream_s / max(positions, 1), last_s / max(tokens, 1))
        for d, value in zip(self._parts, parts, strict=True):
            d.append(value)
        self.fixed, self.per_position, self.per_token = (statistics.median(d) for d in self._parts)


@dataclass
class SpecStats:
    """Counters of one engine's decode passes, for ``/api/status``."""

    mode: SpeculateMode = "auto"
    passes: int = 0
    """Decode passes (plain steps included)."""
    verify_passes: int = 0
    """Passes that carried drafts."""
    drafted: int = 0
    accepted: int = 0
    tokens: int = 0
    """Tokens the passes produced."""
    window: int = 0
    """Drafts in the latest pass."""

    def observe(self, drafted: int, accepted: int, tokens: int) -> None:
        self.passes += 1
        self.verify_passes += drafted > 0
        self.drafted += drafted
        self.accepted += accepted
        self.tokens += tokens
        self.window = drafted

    def status(self) -> dict[str, object]:
        return {
            "mode": self.mode, "passes": self.passes, "verify_passes": self.verify_passes,
            "drafted": self.drafted, "accepted": self.accepted,
            "acceptance": round(self.accepted / self.drafted, 3) if self.drafted else None,
            "tokens_per_pass": round(self.tokens / self.passes, 3) if self.passes else None,
            "window": self.window,
        }
