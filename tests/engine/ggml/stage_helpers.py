"""Shared helpers of the ggml stage runtime tests (a module, not conftest, so tests can import it)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

PROMPT = [1, *np.random.default_rng(1).integers(3, 259, 31).tolist()]
"""A 32-token prompt for the tiny byte-vocabulary models: BOS then random bytes."""

LLAMA_THREADS = 1
"""llama.cpp's threads spin at barriers: on a busy 2-core machine 2 threads ran 8x slower than 1."""


def llama_cpp_scores(path: Path, batches: Sequence[Sequence[int]], **kwargs: object) -> np.ndarray:
    """llama.cpp's logits [tokens, vocab] at every position, evaluating ``batches`` one after another.

    llama.cpp runs with its defaults (f16 KV cache, CPU repacking, flash attention off) unless
    ``kwargs`` say otherwise; one batch per ``eval`` call, as our stage gets one per ``forward``.
    """
    from llama_cpp import Llama

    llm = Llama(model_path=str(path), logits_all=True, verbose=False, n_ctx=256, n_threads=LLAMA_THREADS, **kwargs)
    try:
        for batch in batches:
            llm.eval(list(batch))
        return np.array(llm.scores[: llm.n_tokens], dtype=np.float32)
    finally:
        llm.close()


def max_relative_error(ours: np.ndarray, ref: np.ndarray) -> float:
    """Worst position's largest logit difference relative to that position's largest logit."""
    return float((np.abs(ours - ref).max(axis=1) / np.abs(ref).max(axis=1)).max())
