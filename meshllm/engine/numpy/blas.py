"""Per-thread control of OpenBLAS threads: one thread for decode steps and other small batches.

A decode step is a chain of matrix-vector products that only stream weights from memory. Measured on
the default model's layer shapes on this 2-core host, single-threaded OpenBLAS streams them at about
17 GB/s, while its default two threads managed 2-7 GB/s (its threads synchronise on every small call,
and lose badly whenever another process wants a core): decode ran at 61 ms per token instead of 121
(quiet host) to 800 ms (busy host). Batches of several tokens are compute-bound and keep every
thread (OPENBLAS_NUM_THREADS still caps them). numpy's bundled OpenBLAS exposes
``openblas_set_num_threads_local``, which changes the setting for the calling thread only, so
concurrent stages cannot disturb each other. Without OpenBLAS (another BLAS) this does nothing.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from pathlib import Path

import numpy as np


def _find_setter() -> tuple[Callable[[int], int], int] | None:
    """``openblas_set_num_threads_local`` of numpy's OpenBLAS and the default thread count, if present."""
    libs = Path(np.__file__).parent.parent / "numpy.libs"
    for path in sorted(libs.glob("lib*openblas*.so*")):
        lib = ctypes.CDLL(str(path))
        setter = getattr(lib, "openblas_set_num_threads_local", None)
        getter = getattr(lib, "scipy_openblas_get_num_threads64_", None) or getattr(
            lib, "openblas_get_num_threads", None
        )
        if setter is not None and getter is not None:
            setter.argtypes, setter.restype = [ctypes.c_int], ctypes.c_int
            return setter, int(getter())
    return None


_SETTER = _find_setter()
SMALL_BATCH = 8
"""Batches below this many tokens are matrix-vector-like: bandwidth-bound, best on one thread."""


def use_threads_for(n_tokens: int) -> None:
    """Set the calling thread's BLAS threads for a forward pass over ``n_tokens`` tokens."""
    if _SETTER is not None:
        setter, default = _SETTER
        setter(1 if n_tokens < SMALL_BATCH else default)
