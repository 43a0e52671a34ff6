"""Per-session key/value cache of a stage's layers.

Keys and values of each layer live in one preallocated array per kind, [kv_heads, capacity, head_dim],
so a head's history is contiguous and attention reads it as a view. Capacity doubles when needed (up to
the context limit), which keeps decode free of per-token allocations of the cache. A forward pass writes
its new entries past ``length`` and calls :meth:`KVCache.commit` only when every layer succeeded, so a
failed call leaves the session as it was.
"""

from __future__ import annotations

import numpy as np

from meshllm.engine.numpy.errors import StageInputError

_INITIAL_CAPACITY = 256


class KVCache:
    """Keys and values for ``n_layers`` consecutive layers of one session."""

    def __init__(self, n_layers: int, n_kv_heads: int, head_dim: int, max_tokens: int) -> None:
        self.n_layers = n_layers
        self.n_kv_heads = n_kv_heads
        self.head_dim = head_dim
        self.max_tokens = max_tokens
        self.length = 0
        """Tokens cached so far: the position the next token will have."""
        self._capacity = 0
        self.keys: list[np.ndarray] = []
        self.values: list[np.ndarray] = []

    def reserve(self, n: int) -> None:
        """Make room for ``n`` more tokens, growing the arrays if needed."""
        need = self.length + n
        if need > self.max_tokens:
            raise StageInputError(
                f"context full: {self.length} cached + {n} new tokens exceed the limit of {self.max_tokens}",
                hint="Start a new session, trim this one, or load the stage with a larger context.",
            )
        if need <= self._capacity:
            return
        cap = max(_INITIAL_CAPACITY, self._capacity)
        while cap < need:
            cap *= 2
        cap = min(cap, self.max_tokens)
        shape = (self.n_kv_heads, cap, self.head_dim)
        keys = [np.zeros(shape, np.float32) for _ in range(self.n_layers)]
        values = [np.zeros(shape, np.float32) for _ in range(self.n_layers)]
        for old, new in zip(self.keys + self.values, keys + values, strict=False):
            new[:, : self.length] = old[:, : self.length]  # nothing to copy on the first reservation
        self.keys, self.values, self._capacity = keys, values, cap

    def write(self, layer: int, k: np.ndarray, v: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Store the new ``k``/``v`` [n, kv_heads, head_dim] of ``layer`` after the committed tokens.

        Returns views of the whole history including the new entries, [kv_heads, length + n, head_dim].
        """
        n = k.shape[0]
        end = self.length + n
        self.keys[layer][:, self.length : end] = k.transpose(1, 0, 2)
        self.values[layer][:, self.length : end] = v.transpose(1, 0, 2)
        return self.keys[layer][:, :end], self.values[layer][:, :end]

    def commit(self, n: int) -> None:
        """Make the ``n`` entries written by the last forward pass part of the history."""
        self.length += n

    def trim(self, n: int) -> None:
        """Keep only the first ``n`` tokens (to regenerate from a shared prefix)."""
        if not 0 <= n <= self.length:
            raise StageInputError(f"cannot trim a session of {self.length} tokens to {n}")
        self.length = n

    @property
    def nbytes(self) -> int:
        """Bytes held by the cache arrays now."""
        return sum(a.nbytes for a in self.keys + self.values)
