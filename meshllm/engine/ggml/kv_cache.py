"""Per-session keys and values of a stage's layers, in backend buffers (float16 unless asked otherwise).

Each layer has a K tensor of ``[kv_heads * head_dim, capacity]``: one row per cached token
(position), as llama.cpp's K cache. V is the same with flash attention (its rows may be narrower
than K's: DeepSeek's value heads are narrower than its key heads); for softmax attention it is
stored transposed, ``[capacity, kv_heads * head_dim]`` (one row per value dimension), so that the
attention's ``V x softmax`` product reads it in place, exactly like llama.cpp's ``v_trans`` cache.
Graphs write a step's entries with ``set_rows`` at the session's next positions and attend over a
view of the first ``n_kv`` positions, where ``n_kv`` is the length rounded up to 256
(:func:`padded`), exactly llama.cpp's choice: the view only changes every 256 tokens, so a decode
graph is reused for 256 steps, and summations run over the same number of (masked) terms as
llama.cpp's, which keeps results bit-identical. Entries past the length are zeroed when allocated
and always masked.

Capacity grows by doubling (in steps of 256, up to the session's context limit): the first
``length`` rows are copied into the new buffers and the :attr:`KVCache.generation` changes, which
tells the stage that graphs built over the old tensors are stale. A session's KV is its own set of
tensors, so any number of sessions are addressable at once (a batched step over several sessions
can attend to each one's views).
"""

from __future__ import annotations

import numpy as np

from meshllm.engine.ggml import lib
from meshllm.engine.ggml.backends import Backends
from meshllm.engine.ggml.errors import StageInputError
from meshllm.engine.ggml.graph import Graph, T

PAD = 256
"""KV views are multiples of this many rows (llama.cpp's ``n_pad``)."""
KV_TYPES = {"f16": lib.F16, "f32": lib.F32}


def padded(n: int) -> int:
    """``n`` rounded up to a multiple of :data:`PAD` (at least one)."""
    return max(PAD, -(-n // PAD) * PAD)


class KVCache:
    """Keys and values of one session for ``len(bufts)`` consecutive layers (``bufts[i]``: where layer i's go)."""

    def __init__(self, backends: Backends, bufts: list[int], width: int, kv_type: int, max_tokens: int,
                 v_trans: bool = False, v_width: int | None = None) -> None:
        self.backends = backends
        self.v_trans = v_trans
        """V is stored transposed (softmax attention), one row per value dimension."""
        self.bufts = bufts
        self.width = width
        """Elements per K row: kv_heads x head_dim."""
        self.v_width = width if v_width is None else v_width
        """Elements per V row: kv_heads x value head_dim; 0 when V is read from K's leading dimensions
        (DeepSeek's absorbed latent attention keeps only K, as llama.cpp does)."""
        self.kv_type = kv_type
        self.max_tokens = max_tokens
        self.length = 0
        """Tokens cached so far: the position the next token will have."""
        self.capacity = 0
        self.generation = 0
        """Changes whenever the tensors are reallocated (graphs over the old ones are stale)."""
        self.k: list[T] = []
        self.v: list[T] = []
        self._graph: Graph | None = None
        self._buffers: list[int] = []

    @property
    def limit(self) -> int:
        """Rows the cache may ever hold: the context limit rounded up to :data:`PAD`, as llama.cpp's ``n_ctx``."""
        return padded(self.max_tokens)

    def n_kv(self, end: int) -> int:
        """Rows a graph attends over when the cache holds ``end`` tokens (``end`` rounded up to 256)."""
        return min(self.capacity, padded(end))

    def reserve(self, n: int) -> None:
        """Make room for ``n`` more tokens; refuses past the context limit and changes nothing then."""
        need = self.length + n
        if need > self.max_tokens:
            raise StageInputError(
                f"context full: {self.length} cached + {n} new tokens exceed the limit of {self.max_tokens}",
                hint="Start a new session, trim this one, or load the stage with a larger context.",
            )
        target = min(padded(need), self.limit)
        if target <= self.capacity:
            return
        cap = max(PAD, self.capacity)
        while cap < target:
            cap *= 2
        self._reallocate(min(cap, self.limit))

    def _reallocate(self, capacity: int) -> None:
        b = self.backends
        g = b.g
        graph = Graph(g, max_tensors=2 * len(self.bufts))
        k = [graph.new(self.kv_type, self.width, capacity, name=f"cache_k_l{i}") for i in range(len(self.bufts))]
        v_shape = (capacity, self.v_width) if self.v_trans else (self.v_width, capacity)
        v = [graph.new(self.kv_type, *v_shape, name=f"cache_v_l{i}") for i in range(len(self.bufts))] \
            if self.v_width else []
        buffers = []
        try:
            for buft in dict.fromkeys(self.bufts):
                mine = [t for i, t in enumerate(k) if self.bufts[i] == buft]
                mine += [t for i, t in enumerate(v) if self.bufts[i] == buft]  # no V: none
                buffers.append(b.allocate(buft, mine))
        except BaseException:
            for buf in buffers:
                g.ggml_backend_buffer_free(buf)
            graph.close()
            raise
        if self.length:  # carry the cached entries over, through host memory (rare: capacity doubles)
            staging = np.empty(int(g.ggml_row_size(self.kv_type, self.width)) * self.length, np.uint8)
            for old, new in zip(self.k, k, strict=True):
                g.ggml_backend_tensor_get(old.p, staging.ctypes.data, 0, staging.nbytes)
                g.ggml_backend_tensor_set(new.p, staging.ctypes.data, 0, staging.nbytes)
            staging = np.empty(int(g.ggml_row_size(self.kv_type, self.v_width)) * self.length, np.uint8)
            for old, new in zip(self.v, v, strict=True):
                if not self.v_trans:
                    g.ggml_backend_tensor_get(old.p, staging.ctypes.data, 0, staging.nbytes)
                    g.ggml_backend_tensor_set(new.p, staging.ctypes.data, 0, staging.nbytes)
                    continue
                size = int(g.ggml_row_size(self.kv_type, 1))  # bytes per element
                whole = np.empty((self.v_width, self.capacity * size), np.uint8)
                g.ggml_backend_tensor_get(old.p, whole.ctypes.data, 0, whole.nbytes)
                grown = np.zeros((self.v_width, capacity * size), np.uint8)
                grown[:, : self.length * size] = whole[:, : self.length * size]
                g.ggml_backend_tensor_set(new.p, grown.ctypes.data, 0, grown.nbytes)
        self._free()
        self.k, self.v, self._graph, self._buffers = k, v, graph, buffers
        self.capacity = capacity
        self.generation += 1

    def trim(self, n: int) -> None:
        """Keep only the first ``n`` tokens (to regenerate from a shared prefix, or drop rejected drafts)."""
        if not 0 <= n <= self.length:
            raise StageInputError(f"cannot trim a session of {self.length} tokens to {n}")
        self.length = n

    @property
    def nbytes(self) -> int:
        """Bytes of the cache's buffers now."""
        return sum(int(self.backends.g.ggml_backend_buffer_get_size(b)) for b in self._buffers)

    def _free(self) -> None:
        for buf in self._buffers:
            self.backends.g.ggml_backend_buffer_free(buf)
        self._buffers = []
        if self._graph is not None:
            self._graph.close()
            self._graph = None

    def close(self) -> None:
        """Free the buffers (the session is gone)."""
        self._free()
        self.k, self.v = [], []
        self.capacity = self.length = 0
        self.generation += 1


def kv_bytes_per_token(n_layers: int, width: int, kv_type: str = "f16", v_width: int | None = None) -> int:
    """Bytes one token of context costs in a stage of ``n_layers`` layers (keys of ``width``, values of
    ``v_width``, the same unless given)."""
    return n_layers * (width + (width if v_width is None else v_width)) * {"f16": 2, "f32": 4}[kv_type]
