"""Per-session recurrent state of a stage's recurrent layers (Qwen 3.5's gated delta-net), beside its KV cache.

A recurrent layer carries no keys and values: it folds every token it has seen into a fixed-size state
(per layer, the last ``d_conv - 1`` columns of its causal convolution and one [head, head] matrix per
value head of its delta rule), f32 like llama.cpp's recurrent memory, in the layer's backend buffer.
A step reads the state and writes the next one in the same graph (the write is expanded after the read).

Unlike a KV cache, such a state cannot be cut back: the state after ``n`` tokens is gone once the
``n+1``-th is folded in. A trim (rejected speculative tokens, a prompt re-sent from an earlier
position) is therefore a *rewind*: the state is restored to a checkpoint at or before the target and
the session's kept inputs from there to the target are run again. For that the state keeps

- the inputs of every step (token ids on a first stage, the f32 hand-over rows on a later one), in order;
- one checkpoint: a host copy of the state taken at the start of the latest multi-row step (a prompt
  chunk or a verify window, the steps that are later cut back), so the usual rewind — into the last
  window — replays only the window's accepted rows; a rewind before it replays from position 0, where
  the state is all zeros (a re-prefill from the kept inputs).

Rewinds are lazy: :meth:`truncate` only forgets, and the stage rebuilds the state when the session
next runs (:attr:`at` then differs from the position asked for), the same way after a failed step.
"""

from __future__ import annotations

import ctypes

import numpy as np

from meshllm.engine.ggml import lib
from meshllm.engine.ggml.backends import Backends
from meshllm.engine.ggml.graph import Graph, T
from meshllm.engine.ggml.hparams import SsmShape


class RecurrentState:
    """One session's recurrent state for ``len(bufts)`` recurrent layers (``bufts[i]``: where layer i's lives)."""

    def __init__(self, backends: Backends, bufts: list[int], ssm: SsmShape) -> None:
        self.backends = backends
        self.ssm = ssm
        g = backends.g
        self._graph = Graph(g, max_tensors=max(2, 2 * len(bufts)))
        self.conv: list[T] = [self._graph.new(lib.F32, ssm.conv_elements, name=f"cache_r_l{i}")
                              for i in range(len(bufts))]
        """Per layer, the convolution's kept columns: [d_conv - 1, channels] flattened."""
        self.delta: list[T] = [self._graph.new(lib.F32, ssm.state_elements, name=f"cache_s_l{i}")
                               for i in range(len(bufts))]
        """Per layer, the delta rule's state: [head, head, v_heads] flattened."""
        self._buffers: list[int] = []
        try:
            for buft in dict.fromkeys(bufts):
                mine = [t for i, t in enumerate(self.conv) if bufts[i] == buft]
                mine += [t for i, t in enumerate(self.delta) if bufts[i] == buft]
                self._buffers.append(backends.allocate(buft, mine))  # zeroed: the state before any token
        except BaseException:
            self.close()
            raise
        self.at: int | None = 0
        """The position the state stands at (tokens folded in); ``None`` after a failed step."""
        self._inputs: list[np.ndarray] = []
        self._kept = 0
        self._checkpoint: tuple[int, list[np.ndarray]] | None = None

    # -- what it holds --------------------------------------------------------------------------

    @property
    def tensors(self) -> list[T]:
        return [*self.conv, *self.delta]

    @property
    def kept(self) -> int:
        """Input rows kept (the positions ``0 .. kept-1``)."""
        return self._kept

    @property
    def nbytes(self) -> int:
        """Bytes held: the state on its backends, the kept inputs and the checkpoint."""
        g = self.backends.g
        held = sum(int(g.ggml_backend_buffer_get_size(b)) for b in self._buffers)
        held += sum(x.nbytes for x in self._inputs)
        if self._checkpoint is not None:
            held += sum(a.nbytes for a in self._checkpoint[1])
        return held

    # -- inputs and rewinds --------------------------------------------------------------------

    def record(self, pos: int, rows: np.ndarray) -> None:
        """Keep the inputs of a step at ``pos`` that ran; the state now stands after them."""
        if pos != self._kept:
            raise ValueError(f"inputs at {pos} do not follow the {self._kept} kept")
        self._inputs.append(np.array(rows, copy=True))
        self._kept += len(rows)
        self.at = self._kept

    def inputs(self, start: int, end: int) -> np.ndarray:
        """The kept input rows of positions [start, end)."""
        parts, offset = [], 0
        for x in self._inputs:
            lo, hi = max(start - offset, 0), min(end - offset, len(x))
            if lo < hi:
                parts.append(x[lo:hi])
            offset += len(x)
        return np.concatenate(parts)

    def truncate(self, n: int) -> None:
        """Forget the inputs from position ``n`` on (and a checkpoint past it); the state is rebuilt lazily."""
        if n >= self._kept:
            return
        kept, offset = [], 0
        for x in self._inputs:
            if offset + len(x) <= n:
                kept.append(x)
            elif offset < n:
                kept.append(x[: n - offset].copy())
            offset += len(x)
        self._inputs, self._kept = kept, n
        if self._checkpoint is not None and self._checkpoint[0] > n:
            self._checkpoint = None
        if self.at is not None and self.at > n:
            self.at = None  # past the target: only a rebuild can bring it back

    def save(self) -> None:
        """Checkpoint the state where it stands (before a multi-row step that may be cut back)."""
        assert self.at is not None
        g = self.backends.g
        copies = []
        for t in self.tensors:
            out = np.empty(t.n_elements, np.float32)
            g.ggml_backend_tensor_get(t.p, ctypes.c_void_p(out.ctypes.data), 0, out.nbytes)
            copies.append(out)
        self._checkpoint = (self.at, copies)

    def restore(self, target: int) -> int:
        """Put the state at the latest point at or before ``target`` it can be restored to; that position.

        The checkpoint when it is not past ``target``, else position 0 (zeros). The caller replays the
        kept inputs from there to ``target``.
        """
        g = self.backends.g
        if self._checkpoint is not None and self._checkpoint[0] <= target:
            pos, copies = self._checkpoint
            for t, data in zip(self.tensors, copies, strict=True):
                g.ggml_backend_tensor_set(t.p, ctypes.c_void_p(data.ctypes.data), 0, data.nbytes)
        else:
            pos = 0
            for buf in self._buffers:
                g.ggml_backend_buffer_clear(buf, 0)
        self.at = pos
        return pos

    def close(self) -> None:
        """Free the state's buffers (the session is gone)."""
        for buf in self._buffers:
            self.backends.g.ggml_backend_buffer_free(buf)
        self._buffers = []
        self._graph.close()
        self._inputs, self._kept, self._checkpoint = [], 0, None


def state_bytes(ssm: SsmShape, n_layers: int) -> int:
    """Bytes of the recurrent state of ``n_layers`` recurrent layers for one session (without kept inputs)."""
    return n_layers * (ssm.conv_elements + ssm.state_elements) * 4
