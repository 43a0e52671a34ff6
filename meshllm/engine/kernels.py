"""Which ggml CPU kernels the node's engines use: one choice for llama.cpp and the ggml stage runtime.

ggml's CPU backend computes a matrix row differently depending on how the weights are laid out and
how many rows the call holds: repacked (interleaved) quantized matrices and the tiled K-quant matmul
(taken from 8 rows up) accumulate in another order than the plain row-by-row kernels. ``exact``
keeps weights in their file layout and turns the tiled matmul off, so a row's result never depends
on what else is in the batch (answers do not change with load, a prompt cache or a split), and the
llama.cpp engine and the stage runtime compute bit for bit the same. ``fast`` allows both.

Both settings are per process in part: ``GGML_CPU_TILED_MM`` is read once, at ggml's first matmul,
so a node uses one choice for all its engines (``meshllm serve --kernels``).
"""

from __future__ import annotations

import os
from typing import Literal

Kernels = Literal["exact", "fast"]
"""``exact``: kernels that compute a row the same way whatever else is in the batch; ``fast``: also
ggml's repacked and tiled kernels."""
KERNELS: tuple[Kernels, ...] = ("exact", "fast")


def use_kernels(kernels: Kernels) -> bool:
    """Set the process-wide part of ``kernels`` (before the first matmul); returns whether to repack weights."""
    if kernels == "exact":
        os.environ.setdefault("GGML_CPU_TILED_MM", "0")
    return kernels == "fast"
