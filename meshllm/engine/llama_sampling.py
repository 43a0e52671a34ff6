"""Choosing a slot's next token: llama.cpp's samplers, and a random draw that depends on (seed, step) only.

Penalties (repetition, presence, frequency), top-k, top-p, min-p and temperature run as one llama.cpp
sampler chain per slot; a GBNF grammar
is a second sampler of the same slot. The final random draw is ours: a uniform number computed
from the request's seed and the step (the index of the token being generated,
:func:`meshllm.engine.sampler.step_uniform`), inverted over the candidates in token-id order as the
numpy sampler does, so the draw of step ``k`` does not depend on how many draws came before it, nor
on the engine. An engine that resumes a request
from ``k`` tokens generated elsewhere (``continuation``) feeds them to the samplers' histories and
then draws what the first engine would have drawn at step ``k``.

A grammar is checked the way llama.cpp's own server does it: the token chosen without the grammar
is kept if the grammar allows it (one candidate to check), and only otherwise is the whole
vocabulary constrained and the choice made again, with the same uniform number.
"""

from __future__ import annotations

import numpy as np

from meshllm.engine.base import GenerationParams, InvalidRequest, TokenLogprob
from meshllm.engine.llama_native import Candidates, NativeModel, NativeSampler
from meshllm.engine.sampler import (
    PENALTY_WINDOW,
    check_logprobs,
    logprob_entry,
    request_seed,
    step_uniform,
    token_logprobs,
)


class SlotSampler:
    """The samplers of one request in one slot."""

    def __init__(self, model: NativeModel, params: GenerationParams) -> None:
        check_logprobs(params)
        self.model = model
        self.greedy = params.temperature <= 0.0
        self.seed = request_seed(params)
        self.top_logprobs = params.logprobs
        self.grammar = NativeSampler.grammar(model, params.grammar) if params.grammar else None
        try:
            self.chain = NativeSampler.chain(
                model, presence=params.presence_penalty, frequency=params.frequency_penalty,
                top_k=params.top_k or 0, top_p=params.top_p, min_p=params.min_p, repeat=params.repeat_penalty,
                temperature=None if self.greedy else params.temperature, penalty_window=PENALTY_WINDOW)
        except BaseException:
            self.close()
            raise
        self._candidates: Candidates | None = None

    def sample(self, logits: np.ndarray, step: int) -> int | None:
        """The token for generation step ``step``; ``None`` when the grammar allows no token at all."""
        u = step_uniform(self.seed, step)
        if self.chain is None:  # greedy without penalties: the most likely token
            token: int | None = int(np.argmax(logits))
        else:
            token = self._choose(logits, u, constrain=False)
        if token is not None and self.grammar is not None and not self.grammar.allows(token):
            token = self._choose(logits, u, constrain=True)
        return token

    def _choose(self, logits: np.ndarray, u: float, constrain: bool) -> int | None:
        if self._candidates is None:
            self._candidates = Candidates(self.model.n_vocab)
        cand = self._candidates
        cand.load(logits)
        if constrain:
            assert self.grammar is not None
            self.grammar.apply(cand)
        if self.chain is not None:
            self.chain.apply(cand)
        ids, z = cand.current()
        finite = np.isfinite(z)
        if not finite.any():
            return None
        if self.greedy:
            return int(ids[int(np.argmax(z))])
        order = np.argsort(ids, kind="stable")  # token-id order, as the numpy sampler draws
        ids, z = ids[order], z[order]
        w = np.exp(z.astype(np.float64) - z[np.isfinite(z)].max())
        cum = np.cumsum(w)
        return int(ids[min(int(np.searchsorted(cum, u * cum[-1], side="right")), len(ids) - 1)])

    def accept(self, token: int) -> None:
        """Record a generated token (not the end-of-generation one) in the penalty and grammar state."""
        if self.chain is not None:
            self.chain.accept(token)
        if self.grammar is not None:
            self.grammar.accept(token)

    def replay(self, tokens: tuple[int, ...]) -> None:
        """Record tokens generated elsewhere; refuse a continuation the grammar would not have produced."""
        for i, token in enumerate(tokens):
            if self.grammar is not None and not self.grammar.allows(token):
                raise InvalidRequest(f"continuation token {i} ({token}) is not allowed by the request's grammar")
            self.accept(token)

    def logprob(self, logits: np.ndarray, token: int) -> TokenLogprob | None:
        """``token``'s log-probability and the top alternatives, from the raw logits (``None``: not asked)."""
        if self.top_logprobs is None:
            return None
        return logprob_entry(self.model.piece, token, *token_logprobs(logits, token, self.top_logprobs))

    def close(self) -> None:
        for sampler in (self.grammar, getattr(self, "chain", None)):
            if sampler is not None:
                sampler.close()
