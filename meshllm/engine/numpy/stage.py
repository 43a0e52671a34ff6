"""A stage: the layers [layer_start, layer_end) of a GGUF model, run with numpy.

The first stage turns token ids into activations; a later stage continues from the activations the
previous stage handed over; the last stage ends with the output norm and head and returns logits. A
single stage spanning every layer is the whole model (what :class:`NumpyEngine` uses). Running
[0, k) then [k, n) on the hand-over computes exactly the same float32 operations as [0, n), so a split
model's logits are bit-identical to the whole model's.

Each session (a conversation, a request) has its own :class:`KVCache`; positions are implicit: a
forward call continues at the session's cached length, which the caller states as ``pos`` so that a
stage out of step with the coordinator fails loudly instead of attending to the wrong history.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np

from meshllm.engine.numpy import gemma3, llama
from meshllm.engine.numpy.blas import use_threads_for
from meshllm.engine.numpy.errors import StageInputError
from meshllm.engine.numpy.gguf_file import GGUFFile
from meshllm.engine.numpy.hparams import HParams, read_hparams
from meshllm.engine.numpy.kv_cache import KVCache
from meshllm.engine.numpy.layers import rms_norm
from meshllm.engine.numpy.rope import Rope
from meshllm.engine.numpy.weights import StageWeights, load_stage, plan_stage

_BLOCKS: dict[str, Callable[..., np.ndarray]] = {"llama": llama.block, "gemma3": gemma3.block}


class StageModel:
    """Layers [layer_start, layer_end) of a model, with per-session KV caches.

    Build with :meth:`load`. ``forward(session, inputs, pos)`` takes token ids [n] on the first stage
    or activations [n, width] float32 on later ones, and returns activations [n, width] or, on the last
    stage, logits [n, vocab] (only the final position's with ``last_only=True``).
    """

    def __init__(self, hp: HParams, weights: StageWeights, layer_start: int, layer_end: int, max_context: int) -> None:
        self.hparams = hp
        self.weights = weights
        self.layer_start = layer_start
        self.layer_end = layer_end
        self.max_context = max_context
        self._block = _BLOCKS[hp.family]
        ropes: dict[object, Rope] = {}
        for il in range(layer_start, layer_end):
            cfg = hp.rope_for(il)
            ropes.setdefault(cfg, Rope(cfg, weights.rope_freqs))
        self._ropes = ropes
        self._sessions: dict[str, KVCache] = {}

    @classmethod
    def load(
        cls, path: str | Path, layer_start: int = 0, layer_end: int | None = None, *, max_context: int | None = None
    ) -> StageModel:
        """Load layers [layer_start, layer_end) (default: to the last) of the GGUF at ``path``.

        Architecture, layer range and every needed tensor's type are validated from the headers before
        anything is dequantized. ``max_context`` caps each session's tokens (default: the model's
        training context).
        """
        reader = GGUFFile(path)
        hp = read_hparams(reader)
        end = hp.n_layers if layer_end is None else layer_end
        plan = plan_stage(reader, hp, layer_start, end)
        weights = load_stage(plan, hp)
        return cls(hp, weights, layer_start, end, max_context or hp.context_length)

    @property
    def first(self) -> bool:
        """Whether this stage takes token ids (holds layer 0 and the embeddings)."""
        return self.layer_start == 0

    @property
    def last(self) -> bool:
        """Whether this stage returns logits (holds the final layer and the head)."""
        return self.layer_end == self.hparams.n_layers

    def session_length(self, session: str) -> int:
        """Tokens cached for ``session`` (0 for an unknown one): the ``pos`` of its next forward call."""
        cache = self._sessions.get(session)
        return cache.length if cache else 0

    def reset(self, session: str) -> None:
        """Drop ``session``'s cache."""
        self._sessions.pop(session, None)

    def trim(self, session: str, n: int) -> None:
        """Keep only the first ``n`` cached tokens of ``session``."""
        cache = self._sessions.get(session)
        if cache is None:
            if n:
                raise StageInputError(f"cannot trim unknown session {session!r} to {n} tokens")
            return
        cache.trim(n)

    def forward(self, session: str, inputs: np.ndarray, pos: int, *, last_only: bool = False) -> np.ndarray:
        """Run the stage's layers on ``inputs`` at positions pos .. pos+n-1 of ``session``."""
        x = self._input_activations(inputs)
        n = x.shape[0]
        cache = self._sessions.get(session)
        if cache is None:
            cache = KVCache(
                self.layer_end - self.layer_start, self.hparams.n_kv_heads, self.hparams.head_dim, self.max_context
            )
        if pos != cache.length:
            raise StageInputError(
                f"session {session!r} is at position {cache.length} on layers "
                f"[{self.layer_start}, {self.layer_end}), but the input starts at {pos}",
                hint="Trim or reset the session so every stage agrees on its length.",
            )
        cache.reserve(n)
        self._sessions[session] = cache
        use_threads_for(n)
        positions = np.arange(pos, pos + n)
        tables = {cfg: rope.tables(positions) for cfg, rope in self._ropes.items()}
        hp = self.hparams
        for slot, il in enumerate(range(self.layer_start, self.layer_end)):
            cfg = hp.rope_for(il)
            x = self._block(
                x, self.weights.layers[slot], hp, self._ropes[cfg], tables[cfg], cache, slot, hp.window_for(il)
            )
        cache.commit(n)
        if not self.last:
            return x
        return self._logits(x[-1:] if last_only else x)

    def _input_activations(self, inputs: np.ndarray) -> np.ndarray:
        """Token ids (first stage) or a float32 [n, width] hand-over, checked and as float32 activations."""
        inputs = np.asarray(inputs)
        if self.first:
            if inputs.ndim != 1 or inputs.size == 0 or not np.issubdtype(inputs.dtype, np.integer):
                raise StageInputError(
                    f"the first stage takes a non-empty 1-D array of token ids, got {inputs.dtype}{inputs.shape}"
                )
            if inputs.min() < 0 or inputs.max() >= self.hparams.vocab:
                raise StageInputError(f"token id outside the vocabulary of {self.hparams.vocab}")
            x = self.weights.embed_rows(inputs)
            if self.hparams.embed_scale != 1.0:
                x *= np.float32(self.hparams.embed_scale)
            return x
        if (
            inputs.ndim != 2
            or inputs.shape[0] == 0
            or inputs.shape[1] != self.hparams.width
            or inputs.dtype != np.float32
        ):
            raise StageInputError(
                f"layers [{self.layer_start}, {self.layer_end}) take float32 activations [n, {self.hparams.width}], "
                f"got {inputs.dtype}{inputs.shape}"
            )
        return inputs

    def _logits(self, x: np.ndarray) -> np.ndarray:
        """Output norm, head and optional soft-capping: [n, width] -> [n, vocab]."""
        w = self.weights
        assert w.head is not None and w.output_norm is not None
        logits = rms_norm(x, w.output_norm, self.hparams.rms_eps) @ w.head
        if w.head_bias is not None:
            logits += w.head_bias
        cap = self.hparams.final_logit_softcap
        if cap:
            logits /= np.float32(cap)
            np.tanh(logits, out=logits)
            logits *= np.float32(cap)
        return logits
