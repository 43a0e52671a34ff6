"""Grammars for the engines that sample from logits they compute themselves.

The llama.cpp engine constrains inside llama.cpp's own sampler chain (``engine/llama_sampling.py``).
The ggml runtime (``--engine ggml``) and the last stage of a split chain compute their logits in
the stage runtime and draw with :class:`meshllm.engine.sampler.Sampler`; they constrain with the
same llama.cpp grammar sampler, over the model's vocabulary loaded alone (``vocab_only``: metadata
and tokens, no tensors, well under a second). A stage file carries the model's metadata verbatim,
so a last stage that fetched only its layers has the vocabulary too.

The grammar text is checked (:func:`meshllm.engine.gbnf.check_grammar`) before llama.cpp parses
it, wherever it comes from, and a token reaches llama.cpp's grammar only once it is known to be
allowed: accepting a token the grammar forbids throws inside llama.cpp, which aborts the process.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from meshllm.engine.base import EngineError, InvalidRequest
from meshllm.engine.llama_native import Candidates, NativeModel, NativeSampler


class Vocab:
    """A GGUF's vocabulary without its weights: what a grammar matches the tokens' text against.

    It is freed when the last reference goes (a :class:`Grammar` holds one: llama.cpp's grammar
    points into the vocabulary), so no session can outlive the vocabulary it samples over.
    """

    def __init__(self, path: Path) -> None:
        self.model = NativeModel(path, vocab_only=True)
        self.n_vocab = self.model.n_vocab
        self.end_token = self.model.eos
        """The token that ends a text the grammar allows nothing more of (``-1``: the model has none)."""

    def __del__(self) -> None:
        model = getattr(self, "model", None)
        if model is not None:
            model.close()


class Grammar:
    """One request's GBNF grammar (start rule ``root``), following the tokens generated so far."""

    def __init__(self, vocab: Vocab, text: str) -> None:
        """Raises :class:`~meshllm.engine.gbnf.BadGrammar` for a grammar that is not valid GBNF or that
        llama.cpp refuses (left recursion)."""
        self.vocab = vocab
        self._sampler = NativeSampler.grammar(vocab.model, text)
        self._candidates: Candidates | None = None

    def allows(self, token: int) -> bool:
        """Whether ``token`` may come next (the state does not change)."""
        return 0 <= token < self.vocab.n_vocab and self._sampler.allows(token)

    def mask(self, logits: np.ndarray) -> np.ndarray:
        """A copy of ``logits`` with every token the grammar forbids next at ``-inf``.

        Logits beyond the vocabulary's tokens (a padded output layer) are never allowed.
        """
        n = self.vocab.n_vocab
        if logits.size < n:
            raise EngineError(f"{logits.size} logits for a vocabulary of {n} tokens")
        if self._candidates is None:
            self._candidates = Candidates(n)
        cand = self._candidates
        cand.load(logits[:n])
        self._sampler.apply(cand)
        out = np.full(logits.size, -np.inf, dtype=np.float32)
        ids, z = cand.current()
        out[ids] = z
        return out

    def accept(self, token: int) -> None:
        """Advance over a generated token the grammar allows (an end token ends the text: no state)."""
        if self.vocab.model.is_eog(token):
            return
        if not self.allows(token):
            raise EngineError(f"token {token} is not allowed by the grammar here")
        self._sampler.accept(token)

    def replay(self, tokens: Sequence[int]) -> None:
        """Advance over tokens generated elsewhere (a continuation); refuse one the grammar would not
        have produced (:class:`InvalidRequest`: the client sent it)."""
        for i, token in enumerate(tokens):
            if not self.allows(token):
                raise InvalidRequest(f"continuation token {i} ({token}) is not allowed by the request's grammar")
            self.accept(token)

    def close(self) -> None:
        """Free llama.cpp's grammar now (it is freed with the object otherwise)."""
        self._sampler.close()

    def __del__(self) -> None:
        sampler = getattr(self, "_sampler", None)
        if sampler is not None:
            sampler.close()
