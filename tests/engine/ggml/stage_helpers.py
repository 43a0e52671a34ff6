"""Shared helpers of the ggml stage runtime tests (a module, not conftest, so tests can import it)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

PROMPT = [1, *np.random.default_rng(1).integers(3, 259, 31).tolist()]
"""A 32-token prompt for the tiny byte-vocabulary models: BOS then random bytes."""

LLAMA_THREADS = 1
"""llama.cpp's threads spin at barriers: on a busy 2-core machine 2 threads ran 8x slower than 1."""


def llama_cpp(path: Path, kernels: str = "exact", **kwargs: Any) -> Any:
    """A llama-cpp-python ``Llama`` on the kernels a stage loaded with ``kernels=`` uses.

    ``exact`` (the node's default) keeps weights in their file layout, ``fast`` repacks them (llama.cpp's
    own default). ``Llama`` has no argument for llama.cpp's ``use_extra_bufts``, so the model parameters
    it starts from are set for the duration of the load.
    """
    import llama_cpp.llama as high
    from llama_cpp import Llama

    default = high.llama_cpp.llama_model_default_params

    def params() -> Any:
        made = default()
        made.use_extra_bufts = kernels == "fast"
        return made

    high.llama_cpp.llama_model_default_params = params
    try:
        return Llama(model_path=str(path), verbose=False, n_threads=LLAMA_THREADS, **kwargs)
    finally:
        high.llama_cpp.llama_model_default_params = default


def llama_cpp_scores(path: Path, batches: Sequence[Sequence[int]], kernels: str = "exact",
                     **kwargs: object) -> np.ndarray:
    """llama.cpp's logits [tokens, vocab] at every position, evaluating ``batches`` one after another.

    llama.cpp runs with the kernels of ``kernels`` (see :func:`llama_cpp`), an f16 KV cache and
    flash attention off unless ``kwargs`` say otherwise; one batch per ``eval`` call, as our stage gets
    one per ``forward``.
    """
    llm = llama_cpp(path, kernels, logits_all=True, n_ctx=256, **kwargs)
    try:
        for batch in batches:
            llm.eval(list(batch))
        return np.array(llm.scores[: llm.n_tokens], dtype=np.float32)
    finally:
        llm.close()


def max_relative_error(ours: np.ndarray, ref: np.ndarray) -> float:
    """Worst position's largest logit difference relative to that position's largest logit."""
    return float((np.abs(ours - ref).max(axis=1) / np.abs(ref).max(axis=1)).max())
