"""Per-session recurrent state of a stage's recurrent layers (Qwen 3.5's gated delta-net), beside its KV cache.

A recurrent layer carries no keys and values: it folds every token it has seen into a fixed-size state
(per layer, the last ``d_conv - 1`` columns of its causal convolution and one [head, head] matrix per
value head of its delta rule), f32 like llama.cpp's recurrent memory, in the layer's backend buffer.
A step reads the state and writes the next one in the same graph (the write is expanded after the read).

Unlike a KV cache, such a state cannot be cut back: the state after ``n`` tokens is gone once the
``n+1``-th is folded in. A trim (rejected speculative tokens, a prompt re-sent from an earlier
position) is therefore a *rewind*, from two things the state keeps:

- **snapshots**: copies of the state (in the same backend buffers, copied on the device): *anchors*
  after every prompt chunk, every :data:`ANCHOR_EVERY` positions and at every rewind target, and once
  the session has been trimmed (it speculates) one before every step; at most :data:`SNAPSHOTS`, the
  oldest dropped first except the latest anchor. So a rejected draft near the end of a window is a
  copy back, a trim into the latest window replays at most that window, and a first rejection at
  most :data:`ANCHOR_EVERY` steps and its window;
- **the inputs of every step** (token ids on a first stage, the f32 hand-over rows on a later one),
  in order and grouped as they ran: the stage replays the steps from the latest snapshot at or
  before the target (or from position 0, where the state is zeros) with exactly the calls they first
  ran as, so the rebuilt state and KV rows are bit for bit the ones a session that never went past
  the target holds.

Rewinds are lazy: :meth:`RecurrentState.truncate` only forgets, and the stage rebuilds the state
when the session next runs (:attr:`RecurrentState.at` then differs from the position asked for),
the same way after a failed step.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from meshllm.engine.ggml import lib
from meshllm.engine.ggml.backends import Backends
from meshllm.engine.ggml.graph import Graph, T
from meshllm.engine.ggml.hparams import SsmShape

SNAPSHOTS = 6
"""Snapshots of the state a session keeps at most (a speculating session takes one per step)."""
ANCHOR_EVERY = 16
"""Positions between anchors of a session that does not speculate: its first rejected draft replays
at most this many steps (and its window)."""


class RecurrentState:
    """One session's recurrent state for ``len(bufts)`` recurrent layers (``bufts[i]``: where layer i's lives)."""

    def __init__(self, backends: Backends, bufts: list[int], ssm: SsmShape) -> None:
        self.backends = backends
        self.ssm = ssm
        self._bufts = bufts
        self._graph = Graph(backends.g, max_tensors=max(2, 2 * len(bufts) * (1 + SNAPSHOTS)))
        self._buffers: list[int] = []
        # per layer, the convolution's kept columns ([d_conv - 1, channels] flattened) and the delta
        # rule's state ([head, head, v_heads] flattened)
        try:
            self.conv, self.delta = self._allocate("")
        except BaseException:
            self.close()
            raise
        self.at: int | None = 0
        """The position the state stands at (tokens folded in); ``None`` after a failed step."""
        self.speculating = False
        """Whether the session was ever trimmed: it then takes a snapshot at every step."""
        self._steps: list[tuple[int, np.ndarray]] = []
        self._kept = 0
        self._snaps: dict[int, list[T]] = {}
        """Position -> the state there (insertion order: oldest first)."""
        self._free: list[list[T]] = []
        self._anchor: int | None = None

    def _allocate(self, tag: str) -> tuple[list[T], list[T]]:
        """A set of state tensors in the layers' buffers, zeroed (the state before any token)."""
        ssm, n = self.ssm, len(self._bufts)
        conv = [self._graph.new(lib.F32, ssm.conv_elements, name=f"cache_r{tag}_l{i}") for i in range(n)]
        delta = [self._graph.new(lib.F32, ssm.state_elements, name=f"cache_s{tag}_l{i}") for i in range(n)]
        for buft in dict.fromkeys(self._bufts):
            mine = [t for i, t in enumerate(conv) if self._bufts[i] == buft]
            mine += [t for i, t in enumerate(delta) if self._bufts[i] == buft]
            self._buffers.append(self.backends.allocate(buft, mine))
        return conv, delta

    # -- what it holds --------------------------------------------------------------------------

    @property
    def tensors(self) -> list[T]:
        return [*self.conv, *self.delta]

    @property
    def kept(self) -> int:
        """Input rows kept (the positions ``0 .. kept-1``)."""
        return self._kept

    @property
    def snapshots(self) -> list[int]:
        """Positions the state can be copied back to, oldest first."""
        return list(self._snaps)

    @property
    def nbytes(self) -> int:
        """Bytes held: the state and its snapshots on their backends, and the kept inputs."""
        g = self.backends.g
        return sum(int(g.ggml_backend_buffer_get_size(b)) for b in self._buffers) + sum(
            x.nbytes for _, x in self._steps)

    # -- steps, snapshots and rewinds -------------------------------------------------------------

    def record(self, pos: int, rows: np.ndarray) -> None:
        """Keep the inputs of a step at ``pos`` that ran; the state now stands after them."""
        if pos != self._kept:
            raise ValueError(f"inputs at {pos} do not follow the {self._kept} kept")
        self._steps.append((pos, np.array(rows, copy=True)))
        self._kept += len(rows)
        self.at = self._kept
        if len(rows) > 1:  # after a prompt chunk: where generation (and its windows) starts
            self.snapshot(anchor=True)

    def steps(self, start: int, end: int) -> Iterator[np.ndarray]:
        """The kept inputs of positions [start, end) as the steps that ran them (``start`` begins a step)."""
        for pos, rows in self._steps:
            if start <= pos < end:
                yield rows[: end - pos]

    def before_step(self) -> None:
        """Take the snapshot a step calls for: an anchor every :data:`ANCHOR_EVERY` positions, and one
        before every step once the session speculates (a prompt chunk leaves an anchor after it)."""
        assert self.at is not None
        anchor = self.at - (self._anchor or 0) >= ANCHOR_EVERY
        if anchor or self.speculating:
            self.snapshot(anchor=anchor)

    def snapshot(self, *, anchor: bool = False) -> None:
        """Copy the state where it stands (the start of a step) so that a trim can come back to it.

        ``anchor``: the start of a prompt chunk or a rewind target, kept over older snapshots.
        """
        pos = self.at
        assert pos is not None
        if pos not in self._snaps:
            if len(self._snaps) >= SNAPSHOTS:
                oldest = next(p for p in self._snaps if p != self._anchor)
                self._free.append(self._snaps.pop(oldest))
            if self._free:
                copy = self._free.pop()
            else:
                conv, delta = self._allocate(f"_{len(self._snaps)}")
                copy = [*conv, *delta]
            for src, dst in zip(self.tensors, copy, strict=True):
                self.backends.g.ggml_backend_tensor_copy(src.p, dst.p)
            self._snaps[pos] = copy
        if anchor:
            self._anchor = pos

    def truncate(self, n: int) -> None:
        """Forget the inputs from position ``n`` on (and snapshots past it); the state is rebuilt lazily."""
        if n >= self._kept:
            return
        self.speculating = True
        steps = []
        for pos, rows in self._steps:
            if pos + len(rows) <= n:
                steps.append((pos, rows))
            elif pos < n:  # the step's first rows: replayed as one call of them
                steps.append((pos, rows[: n - pos].copy()))
        self._steps, self._kept = steps, n
        for pos in [p for p in self._snaps if p > n]:
            self._free.append(self._snaps.pop(pos))
        if self._anchor is not None and self._anchor > n:
            self._anchor = None
        if self.at is not None and self.at > n:
            self.at = None  # past the target: only a rebuild can bring it back

    def restore(self, target: int) -> int:
        """Put the state at the latest snapshot at or before ``target`` (or zeros at 0); its position.

        The caller replays the kept steps from there to ``target`` (:meth:`steps`).
        """
        g = self.backends.g
        best = max((p for p in self._snaps if p <= target), default=None)
        if best is None:
            for t in self.tensors:  # zeros: the state before any token
                g.ggml_backend_tensor_memset(t.p, 0, 0, g.ggml_nbytes(t.p))
            best = 0
        else:
            for src, dst in zip(self._snaps[best], self.tensors, strict=True):
                g.ggml_backend_tensor_copy(src.p, dst.p)
        self.at = best
        return best

    def close(self) -> None:
        """Free the state's buffers (the session is gone)."""
        for buf in self._buffers:
            self.backends.g.ggml_backend_buffer_free(buf)
        self._buffers = []
        self._graph.close()
        self._steps, self._kept, self._snaps, self._free = [], 0, {}, []


def state_bytes(ssm: SsmShape, n_layers: int, *, snapshots: int = SNAPSHOTS) -> int:
    """Bytes of the recurrent state of ``n_layers`` recurrent layers for one session with ``snapshots``
    copies of it (without the kept inputs)."""
    return (1 + snapshots) * n_layers * (ssm.conv_elements + ssm.state_elements) * 4
