"""Shared helpers of the numpy stage runtime tests (a module, not conftest, so tests can import it)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

PROMPT = [1, *np.random.default_rng(1).integers(3, 259, 31).tolist()]
"""A 32-token prompt for the tiny byte-vocabulary models: BOS then random bytes."""

F32_KV = {"type_k": 0, "type_v": 0}
"""llama.cpp with a float32 KV cache (GGML_TYPE_F32), to compare arithmetic rather than cache precision."""


LLAMA_THREADS = 1
"""llama.cpp's threads spin at barriers: on a busy 2-core machine 2 threads ran 8x slower than 1."""


def llama_cpp_scores(path: Path, tokens: list[int], **kwargs: object) -> np.ndarray:
    """llama.cpp's logits [len(tokens), vocab] at every position of ``tokens`` (one batch)."""
    from llama_cpp import Llama

    llm = Llama(model_path=str(path), logits_all=True, verbose=False, n_ctx=256, n_threads=LLAMA_THREADS, **kwargs)
    try:
        llm.eval(tokens)
        return np.array(llm.scores[: len(tokens)], dtype=np.float32)
    finally:
        llm.close()


def max_relative_error(ours: np.ndarray, ref: np.ndarray) -> float:
    """Worst position's largest logit difference relative to that position's largest logit."""
    return float((np.abs(ours - ref).max(axis=1) / np.abs(ref).max(axis=1)).max())
