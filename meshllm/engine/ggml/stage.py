"""A stage: the layers [layer_start, layer_end) of a GGUF model, run as ggml graphs.

The first stage turns token ids into activations; a later stage continues from the activations the
previous stage handed over; the last stage ends with the output norm and head and returns logits. A
stage spanning every layer is the whole model (what :class:`~meshllm.engine.ggml.engine.GgmlEngine`
serves). ``[0, k)`` then ``[k, n)`` runs exactly the ops of ``[0, n)`` on the same numbers (the hand-over
is the f32 residual stream), so a split model's logits are bit-identical to the whole model's.

Each session (a conversation, a request) has its own :class:`KVCache`; a forward call continues at
the session's cached length, which the caller states as ``pos`` so that a stage out of step with its
coordinator fails loudly instead of attending to the wrong history. Prompts are run in chunks of
:data:`CHUNK` tokens (llama.cpp's default micro-batch, so chunking matches its arithmetic too).

Graphs are kept and reused: a step with the same session, token count, KV view and outputs as an
earlier one only rewrites that graph's inputs (building a graph from Python costs about as much as
computing a small stage's decode step). Each kept graph has its own scheduler and compute buffers;
at most :data:`KEPT_GRAPHS` small ones are kept, least recently used first out.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from meshllm.engine.ggml import lib
from meshllm.engine.ggml.backends import Backends, Device, choose_accelerator, devices, layers_that_fit
from meshllm.engine.ggml.blocks import TENSORS_PER_LAYER, TENSORS_PER_SEGMENT, Shape, Step, read
from meshllm.engine.ggml.errors import StageInputError, UnsupportedModel
from meshllm.engine.ggml.families import family_for
from meshllm.engine.ggml.graph import Graph
from meshllm.engine.ggml.hparams import HParams, read_hparams
from meshllm.engine.ggml.kv_cache import KV_TYPES, KVCache, kv_bytes_per_token
from meshllm.engine.ggml.weights import StagePlan, StageWeights, load_weights, plan_stage
from meshllm.engine.kernels import Kernels, use_kernels
from meshllm.engine.slots import CallCosts
from meshllm.models.gguf_file import GGUFFile

CHUNK = 512
"""Most tokens one graph processes; longer inputs run as consecutive chunks (llama.cpp's ``n_ubatch``)."""
KEPT_GRAPHS = 8
"""Small graphs (decode steps of one session or a batch, short verify windows) kept for reuse per stage."""
REUSE_MAX_TOKENS = 16
"""Graphs for more tokens than this per session (prompt chunks) are built, run and freed."""

_FLOAT_TYPES = frozenset({lib.F32, lib.F16, lib.BF16})
"""Matrix types whose one-row product rounds differently from the same row in a batch."""


@dataclass
class _Compiled:
    """A built and allocated graph, ready to run again with new inputs."""

    key: tuple[object, ...]
    graph: Graph
    step: Step
    sched: int

    def close(self, g: lib.Ggml) -> None:
        g.ggml_backend_sched_free(self.sched)
        self.graph.close()


class StageModel:
    """Layers [layer_start, layer_end) of a model, with per-session KV caches; build with :meth:`load`.

    ``forward(session, inputs, pos)`` takes token ids [n] on the first stage or f32 activations
    [n, width] on later ones, and returns activations [n, width] or, on the last stage, logits
    [n, vocab] (only the final position's with ``last_only=True``).
    """

    def __init__(self, hp: HParams, plan: StagePlan, weights: StageWeights, backends: Backends, *,
                 max_context: int, kv_type: str = "f16", flash_attn: bool = False) -> None:
        self.hparams = hp
        self.plan = plan
        self.weights = weights
        self.backends = backends
        self.layer_start, self.layer_end = plan.start, plan.end
        self.max_context = max_context
        self.kv_type = kv_type
        self.flash_attn = flash_attn
        self._block = family_for(hp.arch).block
        self._sessions: dict[str, KVCache] = {}
        self._graphs: OrderedDict[tuple[object, ...], _Compiled] = OrderedDict()
        self._lock = threading.Lock()
        self._closed = False
        self._kv_bufts = [backends.gpu_buft if lw.on_accelerator else backends.cpu_buft for lw in weights.layers]
        self.compute_bytes = 0
        """Largest compute buffer a graph of this stage has needed so far (all backends)."""
        self.pad_lone_rows = False
        """Give a step of one row a second (scratch) row, so that it computes as it would in a batch
        (:meth:`batch_exact`: float matrices take another kernel for one row than for several)."""
        self._pad: KVCache | None = None
        self._costs = CallCosts()
        """Seconds per decode call by rows: whether a batch of lone rows runs faster as one-row calls."""
        self.path: Path | None = None
        """The GGUF (or stage file) it was loaded from: a last stage reads its vocabulary there for grammars."""

    @classmethod
    def load(cls, path: str | Path, layer_start: int = 0, layer_end: int | None = None, *,
             max_context: int | None = None, threads: int | None = None, kv_type: str = "f16",
             flash_attn: bool = False, gpu_layers: int | None = None, kernels: Kernels = "exact") -> StageModel:
        """Load layers [layer_start, layer_end) (default: to the last) of the GGUF at ``path``.

        The ggml version, architecture, layer range and every tensor's type and shape are checked
        before anything is mapped. ``max_context`` caps each session's tokens (default: the model's
        training context). ``kv_type`` is ``f16`` (llama.cpp's default) or ``f32``; flash attention
        needs ``f16``. ``gpu_layers``: how many of the stage's layers go to the accelerator (the last
        ones, and the head with the last layer); ``None`` offloads all that fit, 0 none; ignored
        without an accelerator. ``kernels``: the node's kernel choice (``meshllm.engine.kernels``);
        ``exact`` keeps weights unrepacked, like the llama.cpp engine then.
        """
        lib.load()  # refuses an unchecked ggml before anything else happens
        if kv_type not in KV_TYPES:
            raise UnsupportedModel(f"KV cache type {kv_type!r} is not one of {', '.join(KV_TYPES)}")
        if flash_attn and kv_type != "f16":
            raise UnsupportedModel("flash attention needs an f16 KV cache")
        path = Path(path)
        reader = GGUFFile(path)
        hp = read_hparams(reader)
        end = hp.n_layers if layer_end is None else layer_end
        plan = plan_stage(reader, hp, layer_start, end)
        context = max_context or hp.context_length
        accel = choose_accelerator(devices())
        n_gpu = _gpu_layers(plan, hp, context, kv_type, accel, gpu_layers)
        backends = Backends(threads, accel if n_gpu else None, repack=use_kernels(kernels))
        try:
            weights = load_weights(path, plan, backends, on_accelerator=lambda il: il >= end - n_gpu)
        except BaseException:
            backends.close()
            raise
        stage = cls(hp, plan, weights, backends, max_context=context, kv_type=kv_type, flash_attn=flash_attn)
        stage.path = path
        return stage

    # -- what it is ----------------------------------------------------------------------------

    @property
    def first(self) -> bool:
        """Whether this stage takes token ids (holds layer 0 and the embeddings)."""
        return self.layer_start == 0

    @property
    def last(self) -> bool:
        """Whether this stage returns logits (holds the final layer and the head)."""
        return self.layer_end == self.hparams.n_layers

    @property
    def gpu_layers(self) -> int:
        """Layers of this stage on the accelerator (0 on a CPU-only node)."""
        return sum(lw.on_accelerator for lw in self.weights.layers)

    def memory(self) -> dict[str, int]:
        """Bytes held now: weights (in place from the file, copied, on the device), KV caches, compute."""
        w = self.weights
        return {"weights_mapped": w.mapped_bytes, "weights_copied": w.copied_bytes, "weights_device": w.device_bytes,
                "kv": sum(c.nbytes for c in self._sessions.values()), "compute": self.compute_bytes}

    # -- sessions ------------------------------------------------------------------------------

    def session_length(self, session: str) -> int:
        """Tokens cached for ``session`` (0 for an unknown one): the ``pos`` of its next forward call."""
        cache = self._sessions.get(session)
        return cache.length if cache else 0

    def reset(self, session: str) -> None:
        """Forget ``session`` and free its cache and graphs."""
        with self._lock:
            cache = self._sessions.pop(session, None)
            if cache is not None:
                self._drop_graphs(session)
                cache.close()

    def trim(self, session: str, n: int) -> None:
        """Keep only the first ``n`` cached tokens of ``session`` (rejected draft tokens, a shared prefix)."""
        with self._lock:
            self._check_open()
            cache = self._sessions.get(session)
            if cache is None:
                if n:
                    raise StageInputError(f"cannot trim unknown session {session!r} to {n} tokens")
                return
            cache.trim(n)

    def batch_exact(self) -> bool:
        """Make every row's result independent of the rows beside it; whether lone rows get padded.

        Under exact kernels, quantized matrices compute a row the same way alone and in a batch
        (measured bit for bit on the default model, every split point); float matrices (F32, F16,
        BF16) take ggml's one-row kernel for a lone row and a tiled one for several, which round
        differently. So a stage with float matrices gives a lone row a scratch row beside it from
        then on (one more row of compute). Serving batches calls this; a stage used alone (llama.cpp
        parity, the whole-model engine) computes as llama.cpp does, without padding.
        """
        with self._lock:
            self._check_open()
            if self._pad is None:
                self.pad_lone_rows = any(t.type_id in _FLOAT_TYPES and len(t.shape) > 1 for t in self.plan.tensors())
                self._pad = KVCache(self.backends, self._kv_bufts, self.hparams.k_width, KV_TYPES[self.kv_type], 1,
                                    v_trans=not self.flash_attn, v_width=self.hparams.v_width)
            return self.pad_lone_rows

    # -- compute ------------------------------------------------------------------------------

    def forward(self, session: str, inputs: np.ndarray, pos: int, *, last_only: bool = False) -> np.ndarray:
        """Run the stage's layers on ``inputs`` at positions ``pos .. pos+n-1`` of ``session``.

        Returns activations [n, width], or on the last stage logits [n, vocab] for every position
        (``last_only``: the final position's only, [1, vocab]). A failed call leaves the session as it
        was: its length only advances once every chunk has run.
        """
        inputs = self._checked(inputs)
        n = inputs.shape[0]
        with self._lock:
            cache = self._cache_at(session, pos, n)
            outs = []
            for start in range(0, n, CHUNK):
                chunk = inputs[start : start + CHUNK]
                final = start + CHUNK >= n
                n_out = (1 if last_only else len(chunk)) if self.last else 0
                started = time.perf_counter()
                out = self._run([(session, cache, pos + start, len(chunk), n_out)], chunk)[: n_out or len(chunk)]
                if n == 1:
                    self._costs.observe(1, time.perf_counter() - started)
                if not self.last or not last_only or final:
                    outs.append(out)
            cache.length += n
        return outs[0] if len(outs) == 1 else np.concatenate(outs)

    def forward_batch(self, steps: Sequence[tuple[str, np.ndarray, int]], *,
                      last_only: bool = False) -> list[np.ndarray]:
        """:meth:`forward` for several sessions at once: one graph over all their rows.

        ``steps`` are ``(session, inputs, pos)`` of distinct sessions, at most :data:`CHUNK` rows in
        all. Every row-wise op (projections, FFN, head) runs once for the batch; each session's rows
        write and attend to its own KV cache. Under exact kernels a row's result does not depend on
        the other rows, so each session gets what :meth:`forward` would give it alone. Returns each
        session's output in order; a failed call leaves every session as it was.

        A batch of one-row steps runs as one-row graphs instead while they are measured cheaper
        (:class:`~meshllm.engine.slots.CallCosts`, as the llama.cpp engine does: on a CPU a lone row
        streams the weights, a few rows are compute-bound); the rows' results are the same either way.
        """
        if len(steps) == 1:
            session, inputs, pos = steps[0]
            return [self.forward(session, inputs, pos, last_only=last_only)]
        if not steps or len({s for s, _, _ in steps}) != len(steps):
            raise StageInputError("a batch holds one step for each of several distinct sessions")
        checked = [self._checked(x) for _, x, _ in steps]
        if sum(len(x) for x in checked) > CHUNK:
            raise StageInputError(f"a batch holds at most {CHUNK} rows, got {sum(len(x) for x in checked)}")
        n_outs = [(1 if last_only else len(x)) if self.last else 0 for x in checked]
        with self._lock:
            caches = [self._cache_at(s, pos, len(x)) for (s, _, pos), x in zip(steps, checked, strict=True)]
            segments = [(s, cache, pos, len(x), n_out)
                        for (s, _, pos), x, cache, n_out in zip(steps, checked, caches, n_outs, strict=True)]
            rows = len(checked) if all(len(x) == 1 for x in checked) else 0
            started = time.perf_counter()
            if rows and not self.pad_lone_rows and self._costs.split(rows):
                outs = []
                for seg, x in zip(segments, checked, strict=True):
                    outs.append(self._run([seg], x))
                    self._costs.observe(1, time.perf_counter() - started)
                    started = time.perf_counter()
            else:
                out = self._run(segments, np.concatenate(checked))
                if rows:
                    self._costs.observe(rows, time.perf_counter() - started)
                outs = np.split(out, np.cumsum(n_outs if self.last else [len(x) for x in checked])[:-1])
            for cache, x in zip(caches, checked, strict=True):
                cache.length += len(x)
        return outs

    def _cache_at(self, session: str, pos: int, n: int) -> KVCache:
        """``session``'s cache (a new one for a new session), checked to be at ``pos``, with room for ``n`` more."""
        self._check_open()
        cache = self._sessions.get(session)
        if cache is None:
            cache = KVCache(self.backends, self._kv_bufts, self.hparams.k_width, KV_TYPES[self.kv_type],
                            self.max_context, v_trans=not self.flash_attn, v_width=self.hparams.v_width)
        if pos != cache.length:
            raise StageInputError(
                f"session {session!r} is at position {cache.length} on layers "
                f"[{self.layer_start}, {self.layer_end}), but the input starts at {pos}",
                hint="Trim or reset the session so every stage agrees on its length.",
            )
        cache.reserve(n)
        self._sessions[session] = cache
        return cache

    def _check_open(self) -> None:
        if self._closed:
            raise StageInputError(f"layers [{self.layer_start}, {self.layer_end}) were unloaded")

    def _checked(self, inputs: np.ndarray) -> np.ndarray:
        """Token ids (first stage) or a float32 [n, width] hand-over, checked before ggml sees them."""
        inputs = np.asarray(inputs)
        if self.first:
            if inputs.ndim != 1 or inputs.size == 0 or not np.issubdtype(inputs.dtype, np.integer):
                raise StageInputError(
                    f"the first stage takes a non-empty 1-D array of token ids, got {inputs.dtype}{inputs.shape}"
                )
            if inputs.min() < 0 or inputs.max() >= self.hparams.vocab:
                raise StageInputError(f"token id outside the vocabulary of {self.hparams.vocab}")
            return inputs
        if inputs.ndim != 2 or inputs.shape[0] == 0 or inputs.shape[1] != self.hparams.width or (
                inputs.dtype != np.float32):
            raise StageInputError(
                f"layers [{self.layer_start}, {self.layer_end}) take float32 activations [n, {self.hparams.width}], "
                f"got {inputs.dtype}{inputs.shape}"
            )
        if not np.isfinite(inputs).all():
            raise StageInputError("activations contain NaN or infinity")
        return inputs

    def _run(self, segments: list[tuple[str, KVCache, int, int, int]], inputs: np.ndarray) -> np.ndarray:
        """One graph over ``inputs``: the rows of each ``(session, cache, pos, n, n_out)`` segment in order.

        A lone row gets the scratch row beside it when :attr:`pad_lone_rows` (its output is the last
        row of the result: callers take the rows they asked for).
        """
        if self.pad_lone_rows and len(inputs) == 1 and self._pad is not None:
            self._pad.length = 0
            self._pad.reserve(1)
            segments = [*segments, ("\0pad", self._pad, 0, 1, 1 if self.last else 0)]
            inputs = np.concatenate([inputs, inputs])
        shapes = [Shape(n=n, n_kv=cache.n_kv(pos + n), n_out=n_out) for _, cache, pos, n, n_out in segments]
        key = tuple((seg[0], seg[1].generation, shape) for seg, shape in zip(segments, shapes, strict=True))
        compiled = self._graphs.get(key)
        if compiled is None:
            compiled = self._compile(key, [seg[1] for seg in segments], shapes)
        else:
            self._graphs.move_to_end(key)
        g = self.backends.g
        try:
            compiled.step.set_inputs(g, inputs, [seg[2] for seg in segments])
            status = g.ggml_backend_sched_graph_compute(compiled.sched, compiled.graph.gf)
            if status != lib.STATUS_SUCCESS:
                raise StageInputError(f"ggml could not compute layers [{self.layer_start}, {self.layer_end}) "
                                      f"(status {status})")
            assert compiled.step.out is not None
            return read(g, compiled.step.out)
        finally:
            if key not in self._graphs:
                compiled.close(g)

    def _compile(self, key: tuple[object, ...], caches: list[KVCache], shapes: list[Shape]) -> _Compiled:
        g, b = self.backends.g, self.backends
        per_layer = TENSORS_PER_LAYER + 4 * self.hparams.n_expert_used + (
            TENSORS_PER_SEGMENT * len(shapes) if len(shapes) > 1 else 0)
        graph = Graph(g, max_tensors=64 + 8 * len(shapes) + per_layer * len(self.weights.layers))
        n = sum(s.n for s in shapes)
        try:
            step = Step(graph, self.hparams, self.weights, caches, shapes, first=self.first, last=self.last,
                        flash_attn=self.flash_attn)
            x = step.embed() if self.first else step.x_in
            assert x is not None
            if self.first and self.hparams.embed_scale != 1.0:
                x = graph.scale(x, self.hparams.embed_scale)
            for slot, lw in enumerate(self.weights.layers):
                x = self._block(step, lw, slot, x)
            step.finish(step.head(x) if self.last else x)
        except BaseException:
            graph.close()
            raise
        handles = (lib.ctypes.c_void_p * len(b.backends))(*b.backends)
        sched = g.ggml_backend_sched_new(handles, None, len(b.backends), graph.max_tensors, False, True)
        if not sched:
            graph.close()
            raise UnsupportedModel("ggml could not create a scheduler for the stage's graph")
        compiled = _Compiled(key, graph, step, int(sched))
        if not g.ggml_backend_sched_alloc_graph(sched, graph.gf):
            compiled.close(g)
            raise StageInputError(f"ggml could not allocate compute buffers for {n} tokens",
                                  hint="send shorter prompt chunks, or free memory on this node")
        used = sum(int(g.ggml_backend_sched_get_buffer_size(sched, be)) for be in b.backends)
        self.compute_bytes = max(self.compute_bytes, used)
        if n <= REUSE_MAX_TOKENS * len(shapes):
            self._graphs[key] = compiled
            while len(self._graphs) > KEPT_GRAPHS:
                _, old = self._graphs.popitem(last=False)
                old.close(g)
        return compiled

    def _drop_graphs(self, session: str) -> None:
        for key in [k for k in self._graphs if any(part[0] == session for part in k)]:
            self._graphs.pop(key).close(self.backends.g)

    def close(self) -> None:
        """Free every session, graph, weight buffer and backend."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            g = self.backends.g
            for compiled in self._graphs.values():
                compiled.close(g)
            self._graphs.clear()
            for cache in self._sessions.values():
                cache.close()
            self._sessions.clear()
            if self._pad is not None:
                self._pad.close()
            self.weights.close()
            self.backends.close()

    def __del__(self) -> None:  # a stage dropped without close() still gives its native memory back
        with contextlib.suppress(Exception):
            self.close()


def _gpu_layers(plan: StagePlan, hp: HParams, context: int, kv_type: str, accel: Device | None,
                requested: int | None) -> int:
    """How many of the stage's layers go to ``accel``: ``requested`` (capped), else all that fit."""
    n = plan.end - plan.start
    if accel is None or requested == 0:
        return 0
    if requested is not None:
        return n if requested < 0 else min(requested, n)
    per_layer = max(sum(t.nbytes for t in layer.values()) for layer in plan.layers)
    per_layer += kv_bytes_per_token(1, hp.k_width, kv_type, hp.v_width) * context
    head = plan.head.nbytes if plan.head is not None else 0
    return layers_that_fit(accel.memory_free, per_layer, n, fixed_bytes=head)
