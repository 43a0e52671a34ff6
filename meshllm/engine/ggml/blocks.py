"""The pieces every family's graph is made of, in llama.cpp's order: inputs, norms, rope, attention, head.

A :class:`Step` builds one forward graph of a stage for the tokens of one or more sessions (each
session's ``n`` tokens at its positions ``pos .. pos+n-1``): its input tensors (token ids or the
previous stage's activations, positions, and per session the KV rows to write and the attention
masks; the output rows), the shared blocks, and the output (activations, or logits of the rows in
``out_ids`` on the last stage). The family modules (:mod:`meshllm.engine.ggml.families`) only say
how one layer is wired from these blocks, mirroring llama.cpp's ``src/models/*.cpp`` and
``llm_graph_context`` (``build_norm``, ``build_attn``, ``build_ffn``, ``build_moe_ffn``) op for op,
because the same ops in the same order are what make the logits bit-identical to llama.cpp's.

Inputs are what a reused graph rewrites each step (:meth:`Step.set_inputs`); everything else in the
graph, including the views of the KV cache, stays.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import numpy as np

from meshllm.engine.ggml import lib
from meshllm.engine.ggml.graph import Graph, T
from meshllm.engine.ggml.hparams import HParams, f32_div
from meshllm.engine.ggml.kv_cache import KVCache
from meshllm.engine.ggml.weights import LayerWeights, StageWeights

TENSORS_PER_LAYER = 64
"""Upper bound on ggml tensors one layer's graph creates (ops and views); sizes the graph context."""
TENSORS_PER_SEGMENT = 32
"""More per layer for each session of a batch (its views, KV writes, attention, the concatenation)."""


@dataclass(frozen=True)
class Shape:
    """One session's part of a graph; a graph is reused for another step only when every part is the same."""

    n: int
    """Tokens of the session in the step."""
    n_kv: int
    """KV rows attended over (the cache length after the step, rounded up to 256)."""
    n_out: int
    """Rows of logits the last stage returns (the session's last ``n_out`` tokens); 0 on other stages."""


@dataclass
class _Segment:
    """The rows of one session in a step: where they sit in the batch and the inputs only they use."""

    cache: KVCache
    shape: Shape
    offset: int
    """Index of the session's first row among the step's rows."""
    kv_rows: T
    v_rows: T
    masks: dict[int, T]
    """Attention window (0: unlimited) -> its mask [n_kv, n]."""


class Step:
    """One forward graph under construction (then reused): inputs, blocks, output.

    A step holds the rows of one or more sessions (a batch: continuous batching on split chains).
    Everything row-wise (norms, projections, FFN, head) runs once over all rows; each session's rows
    write its own KV cache and attend only to it, through ops of their own. With one session the graph
    is exactly the single-session graph (no views, no concatenation).
    """

    def __init__(self, graph: Graph, hp: HParams, weights: StageWeights, caches: list[KVCache], shapes: list[Shape],
                 *, first: bool, last: bool, flash_attn: bool) -> None:
        if not shapes or len(caches) != len(shapes):
            raise ValueError("a step has one KV cache per session")
        self.g = graph
        self.hp = hp
        self.w = weights
        self.first = first
        self.last = last
        self.flash_attn = flash_attn
        self.n = n = sum(s.n for s in shapes)
        """Rows of the step (every session's tokens, in order)."""
        if first:
            self.tokens: T | None = graph.new(lib.I32, n, name="inp_tokens", input=True)
            self.x_in: T | None = None
        else:
            self.tokens = None
            self.x_in = graph.new(lib.F32, hp.width, n, name="inp_embd", input=True)
        self.pos = graph.new(lib.I32, n, name="inp_pos", input=True)
        width = hp.v_width
        mask_type = lib.F16 if flash_attn else lib.F32
        windows = sorted({hp.window_for(lw.index) for lw in weights.layers})
        self.segments: list[_Segment] = []
        offset = 0
        for i, (cache, shape) in enumerate(zip(caches, shapes, strict=True)):
            tag = f"_s{i}" if len(shapes) > 1 else ""
            kv_rows = graph.new(lib.I64, shape.n, name=f"inp_kv_rows{tag}", input=True)
            # where V goes: the token rows, or for a transposed V one index per (token, dimension) element
            v_rows = graph.new(lib.I64, shape.n * width, name=f"inp_v_rows{tag}", input=True) \
                if cache.v_trans and width else kv_rows
            masks = {w: graph.new(mask_type, shape.n_kv, shape.n, name=f"inp_kq_mask_w{w}{tag}", input=True)
                     for w in windows}
            self.segments.append(_Segment(cache, shape, offset, kv_rows, v_rows, masks))
            offset += shape.n
        self.n_out = sum(s.n_out for s in shapes)
        self.out_ids = graph.new(lib.I32, self.n_out, name="inp_out_ids", input=True) if last else None
        self.out: T | None = None

    # -- inputs -------------------------------------------------------------------------------

    def set_inputs(self, g: lib.Ggml, inputs: np.ndarray, starts: list[int]) -> None:
        """Write this step's inputs: token ids (first stage) or activations, positions, KV rows, masks.

        ``inputs`` are every session's rows in order, ``starts`` each session's first position. All
        inputs are written before every compute: ggml's allocator may reuse an input's memory once its
        last reader ran, so nothing left in a reused graph's inputs can be trusted.
        """
        if len(starts) != len(self.segments):
            raise ValueError(f"{len(starts)} start positions for {len(self.segments)} sessions")
        if self.tokens is not None:
            _set(g, self.tokens, np.ascontiguousarray(inputs, dtype=np.int32))
        else:
            assert self.x_in is not None
            _set(g, self.x_in, np.ascontiguousarray(inputs, dtype=np.float32))
        per_session = [np.arange(p, p + seg.shape.n, dtype=np.int32) for p, seg in zip(starts, self.segments,
                                                                                     strict=True)]
        _set(g, self.pos, np.concatenate(per_session))
        width = self.hp.v_width
        out_ids = []
        for seg, positions in zip(self.segments, per_session, strict=True):
            _set(g, seg.kv_rows, positions.astype(np.int64))
            if seg.v_rows is not seg.kv_rows:  # element (token i, dim j) of a transposed V: j * capacity + pos_i
                dims = np.arange(width, dtype=np.int64) * seg.cache.capacity
                _set(g, seg.v_rows, (positions.astype(np.int64)[:, None] + dims[None, :]).reshape(-1))
            cells = np.arange(seg.shape.n_kv)[None, :]
            q = positions[:, None]
            visible = cells <= q  # causal: a token sees every earlier position and itself
            for window, mask in seg.masks.items():
                seen = visible & (q - cells < window) if window else visible
                dtype = np.float16 if mask.type == lib.F16 else np.float32
                _set(g, mask, np.where(seen, 0.0, -np.inf).astype(dtype))
            end = seg.offset + seg.shape.n
            out_ids.append(np.arange(end - seg.shape.n_out, end, dtype=np.int32))
        if self.out_ids is not None:
            _set(g, self.out_ids, np.concatenate(out_ids))

    # -- blocks -------------------------------------------------------------------------------

    def norm(self, x: T, weight: T) -> T:
        """RMS norm then the learned scale (llama.cpp's ``build_norm``; the CPU fuses the pair)."""
        return self.g.mul(self.g.rms_norm(x, self.hp.rms_eps), weight)

    def linear(self, x: T, weight: T, bias: T | None = None) -> T:
        y = self.g.mul_mat(weight, x)
        return self.g.add(y, bias) if bias is not None else y

    def rope(self, x: T, layer: int, factors: T | None, offset: int = 0) -> T:
        """Rotary embedding of ``x`` [head_dim, heads, n] as layer ``layer`` uses it (from dimension ``offset``)."""
        cfg = self.hp.rope_for(layer)
        return self.g.rope(
            x, self.pos, factors, n_dims=cfg.n_rot, mode=lib.ROPE_NEOX if cfg.neox else lib.ROPE_NORMAL,
            n_ctx_orig=cfg.n_ctx_orig, freq_base=cfg.freq_base, freq_scale=cfg.freq_scale,
            ext_factor=cfg.ext_factor, attn_factor=cfg.attn_factor, beta_fast=cfg.beta_fast,
            beta_slow=cfg.beta_slow, offset=offset,
        )

    def attention(self, slot: int, layer: int, q: T, k: T, v: T, kq_scale: float, sinks: T | None = None,
                  v_mla: T | None = None) -> T:
        """Store this step's K/V rows in the caches, attend over ``n_kv`` rows; returns [heads*head_dim, n].

        ``q`` is [head_dim, heads, n], ``k``/``v`` [head_dim, kv_heads, n]; llama.cpp's ``build_attn``
        with its KV cache: the writes are expanded into the graph before the attention that reads them.
        In a batch each session's rows are views of the three, attend to that session's cache with
        exactly the ops (and shapes) they would have alone, and the outputs are concatenated in order.
        ``sinks`` (gpt-oss): one learned logit per head that joins every softmax. ``v_mla`` (DeepSeek's
        absorbed latent attention, whose cache keeps no V: ``v`` is the leading part of ``k``): per
        head, the matrix that expands the attended latent values to the value head.
        """
        g = self.g
        g.expand(q)
        g.expand(v)
        g.expand(k)
        if len(self.segments) == 1:
            out = self._attend(self.segments[0], slot, layer, q, k, v, kq_scale, sinks, v_mla)
        else:
            out = None
            for seg in self.segments:
                rows = [self._rows(t, seg) for t in (q, k, v)]
                part = self._attend(seg, slot, layer, *rows, kq_scale, sinks, v_mla)
                out = part if out is None else g.concat(out, part, 1)
            assert out is not None
        g.expand(out)
        return out

    def _rows(self, t: T, seg: _Segment) -> T:
        """The view of ``t`` [head_dim, heads, n] holding ``seg``'s rows."""
        ne0, ne1, _, _ = t.ne
        nb = t.nb
        return self.g.view(t, (ne0, ne1, seg.shape.n), (nb[1], nb[2]), seg.offset * nb[2])

    def _attend(self, seg: _Segment, slot: int, layer: int, q: T, k: T, v: T, kq_scale: float,
                sinks: T | None, v_mla: T | None = None) -> T:
        """One session's K/V writes and attention over its cache: [heads*head_dim, n] for its ``n`` rows."""
        g, hp, cache, n = self.g, self.hp, seg.cache, seg.shape.n
        width, v_width, hd, hd_v = hp.k_width, hp.v_width, hp.head_dim, hp.head_dim_v
        k_cache = cache.k[slot]
        g.expand(g.set_rows(k_cache, g.view(k, (width, n), (k.nb[2],)), seg.kv_rows))
        if not v_width:
            return self._attend_latent(seg, slot, layer, q, v_mla, kq_scale)
        v_cache = cache.v[slot]
        if cache.v_trans:  # one "row" per element: (token, dim) -> dim * capacity + position
            g.expand(g.set_rows(g.reshape(v_cache, 1, v_cache.n_elements), g.reshape(v, 1, v_width * n), seg.v_rows))
        else:
            g.expand(g.set_rows(v_cache, g.view(v, (v_width, n), (v.nb[2],)), seg.kv_rows))
        elt = int(g.g.ggml_row_size(k_cache.type, 1))
        n_kv = seg.shape.n_kv
        keys = g.permute(g.view(k_cache, (hd, hp.n_kv_heads, n_kv), (elt * hd, elt * width)), 0, 2, 1, 3)
        q = g.permute(q, 0, 2, 1, 3)
        mask = seg.masks[hp.window_for(layer)]
        if self.flash_attn:
            values = g.permute(g.view(v_cache, (hd_v, hp.n_kv_heads, n_kv), (elt * hd_v, elt * v_width)), 0, 2, 1, 3)
            out = g.flash_attn(q, keys, values, mask, kq_scale, hp.attn_softcap)
            if sinks is not None:
                g.add_sinks(out, sinks, hp.n_heads, flash=True)
            out = g.f32_accumulation(out)
            return g.reshape(out, hd_v * hp.n_heads, n)
        cap = cache.capacity  # the transposed V: [n_kv, kv_heads, head_dim] -> [n_kv, head_dim, kv_heads]
        strides = (elt * cap * hd_v, elt * cap)
        values = g.permute(g.view(v_cache, (n_kv, hp.n_kv_heads, hd_v), strides), 0, 2, 1, 3)
        kq = g.f32_accumulation(g.mul_mat(keys, q))
        if hp.attn_softcap:  # Gemma 2: c * tanh(scores / c) before the softmax
            kq = g.scale(g.tanh(g.scale(kq, 1.0 / hp.attn_softcap)), hp.attn_softcap)
        kq = g.soft_max(kq, mask, kq_scale)
        if sinks is not None:
            g.add_sinks(kq, sinks, hp.n_heads, flash=False)
        kqv = g.mul_mat(values, kq)
        return g.cont_2d(g.permute(kqv, 0, 2, 1, 3), hd_v * hp.n_heads, n)

    def _attend_latent(self, seg: _Segment, slot: int, layer: int, q: T, v_mla: T | None, kq_scale: float) -> T:
        """Attention over a K-only cache whose values are each key's leading ``head_dim_v`` dimensions,
        expanded per head by ``v_mla`` afterwards (llama.cpp's ``build_attn`` with ``v_mla``)."""
        assert v_mla is not None, "a cache without V needs the per-head value expansion"
        g, hp, n = self.g, self.hp, seg.shape.n
        k_cache = seg.cache.k[slot]
        elt = int(g.g.ggml_row_size(k_cache.type, 1))
        hd, width, n_kv = hp.head_dim, hp.k_width, seg.shape.n_kv
        keys = g.permute(g.view(k_cache, (hd, hp.n_kv_heads, n_kv), (elt * hd, elt * width)), 0, 2, 1, 3)
        values = g.permute(g.view(k_cache, (hp.head_dim_v, hp.n_kv_heads, n_kv), (elt * hd, elt * width)),
                           0, 2, 1, 3)
        q = g.permute(q, 0, 2, 1, 3)
        mask = seg.masks[hp.window_for(layer)]
        if self.flash_attn:
            out = g.f32_accumulation(g.flash_attn(q, keys, values, mask, kq_scale))  # [latent, heads, n]
            out = g.permute(g.mul_mat(v_mla, g.permute(out, 0, 2, 1, 3)), 0, 2, 1, 3)
            return g.reshape(g.cont(out), v_mla.ne[1] * hp.n_heads, n)
        kq = g.soft_max(g.f32_accumulation(g.mul_mat(keys, q)), mask, kq_scale)
        kqv = g.mul_mat(v_mla, g.mul_mat(g.cont(g.transpose(values)), kq))  # [v_head, n, heads]
        return g.cont_2d(g.permute(kqv, 0, 2, 1, 3), v_mla.ne[1] * hp.n_heads, n)

    def ffn(self, x: T, lw: LayerWeights, act: str = "silu", kind: str = "", f32_down: bool = False) -> T:
        """A gated FFN, ``down(act(gate(x)) * up(x))`` with its optional biases (``build_ffn``, parallel gate).

        ``kind`` ``_shexp`` picks a mixture of experts' shared expert; ``f32_down`` asks the down
        projection for f32 accumulation (llama.cpp does for GLM 4).
        """
        up = self.linear(x, lw[f"ffn_up{kind}.weight"], lw.get(f"ffn_up{kind}.bias"))
        gate = self.linear(x, lw[f"ffn_gate{kind}.weight"], lw.get(f"ffn_gate{kind}.bias"))
        down = self.g.mul_mat(lw[f"ffn_down{kind}.weight"], self.g.glu(act, gate, up))
        if f32_down:
            self.g.f32_accumulation(down)
        bias = lw.get(f"ffn_down{kind}.bias")
        return self.g.add(down, bias) if bias is not None else down

    def moe(self, x: T, lw: LayerWeights) -> T:
        """A mixture of gated experts on ``x`` [width, n], op for op llama.cpp's ``build_moe_ffn``.

        The router scores every expert per token (``ffn_gate_inp``, plus its bias when the layer has
        one), and each token takes its ``n_expert_used`` best. Their weights are the scores' softmax or
        sigmoid (``expert_gating``), or for ``softmax_weight`` (gpt-oss) a softmax over the chosen
        logits alone; optionally renormalised to sum to 1 (the sum clamped below at f16's smallest
        normal, as llama.cpp does) and scaled. A selection bias (``exp_probs_b``, DeepSeek V3 / GLM)
        shifts which experts are chosen, not their weights. ``mul_mat_id`` runs only the chosen experts' matrices
        from the stacks (plus their per-expert biases, ``add_id``), then SwiGLU (gpt-oss: its clamped
        variant), and the weighted outputs are summed in expert-rank order.
        """
        g, hp, n = self.g, self.hp, x.ne[1]  # the model's last layer runs only the rows whose logits are wanted
        k, width = hp.n_expert_used, hp.width
        logits = self.linear(x, lw["ffn_gate_inp.weight"], lw.get("ffn_gate_inp.bias"))  # [n_expert, n]
        gating = hp.expert_gating
        probs = {"softmax": g.soft_max_rows, "sigmoid": g.sigmoid}.get(gating, lambda t: t)(logits)
        bias = lw.get("exp_probs_b.bias")  # DeepSeek V3 / GLM: biases the choice, not the weights
        selection = g.add(probs, bias) if bias is not None else probs
        if hp.expert_groups[0] > 1:
            selection = self._best_groups(selection)
        chosen = g.argsort_top_k(selection, k)  # [k, n]
        weights = g.get_rows(g.reshape(probs, 1, hp.n_expert, n), chosen)  # [1, k, n]
        if gating == "softmax_weight":
            weights = g.reshape(g.soft_max_rows(g.reshape(weights, k, n)), 1, k, n)
        if hp.expert_norm:
            w2 = g.reshape(weights, k, n)
            total = g.clamp(g.sum_rows(w2), 6.103515625e-5, float("inf"))
            weights = g.reshape(g.div(w2, total), 1, k, n)
        if hp.expert_scale not in (0.0, 1.0):
            weights = g.scale(weights, hp.expert_scale)
        g.expand(weights)
        cur = g.reshape(x, width, 1, n)

        def experts_of(name: str, inputs: T) -> T:
            out = g.mul_mat_id(lw[f"{name}.weight"], inputs, chosen)
            bias = lw.get(f"{name}.bias")
            return g.add_id(out, bias, chosen) if bias is not None else out

        up = experts_of("ffn_up_exps", cur)  # [expert_ffn, k, n]
        gate = experts_of("ffn_gate_exps", cur)
        act = g.swiglu_oai(gate, up, 1.702, 7.0) if hp.expert_act == "swiglu_oai" else g.glu("silu", gate, up)
        experts = g.mul(experts_of("ffn_down_exps", act), weights)  # [width, k, n]
        g.expand(experts)
        views = [g.view(experts, (width, n), (experts.nb[2],), i * experts.nb[1]) for i in range(k)]
        for v in views:
            g.expand(v)
        out = views[0]
        for v in views[1:]:
            out = g.add(out, v)
            g.expand(out)
        return g.cont(out) if k == 1 else out

    def _best_groups(self, selection: T) -> T:
        """``selection`` [n_expert, n] with every expert outside each token's best groups at -inf.

        A group's score is the sum of its two best experts' scores; llama.cpp's ``build_moe_ffn``
        (DeepSeek V3) with its ops.
        """
        g, hp, n = self.g, self.hp, selection.ne[1]
        groups, used = hp.expert_groups
        per = hp.n_expert // groups
        by_group = g.reshape(selection, per, groups, n)
        best_two = g.get_rows(g.reshape(by_group, 1, per, groups, n), g.argsort_top_k(by_group, 2))  # [1, 2, groups, n]
        scores = g.reshape(g.sum_rows(g.reshape(best_two, 2, groups, n)), groups, n)
        kept = g.argsort_top_k(scores, used)  # [used, n]
        masked = g.set_rows(g.fill(by_group, float("-inf")), g.get_rows(by_group, kept), kept)
        return g.reshape(masked, hp.n_expert, n)

    def output_rows(self, layer: int, *xs: T) -> tuple[T, ...]:
        """In the model's last layer, keep only the rows whose logits are wanted (llama.cpp's ``out_ids``)."""
        if layer != self.hp.n_layers - 1 or self.out_ids is None:
            return xs
        return tuple(self.g.get_rows(x, self.out_ids) for x in xs)

    def embed(self) -> T:
        """Token embeddings of the step's ids (first stage), as f32 [width, n]."""
        assert self.tokens is not None and self.w.embed is not None
        return self.g.get_rows(self.w.embed, self.tokens)

    def head(self, x: T) -> T:
        """Output norm, head (+ bias), optional logit scale and final soft-capping: [width, n_out] -> [vocab, n_out]."""
        w, g = self.w, self.g
        assert w.output_norm is not None and w.head is not None
        logits = self.linear(self.norm(x, w.output_norm), w.head, w.head_bias)
        if self.hp.logit_scale != 1.0:
            logits = g.scale(logits, f32_div(1.0, self.hp.logit_scale))
        cap = self.hp.final_logit_softcap
        if cap:
            logits = g.scale(g.tanh(g.scale(logits, 1.0 / cap)), cap)
        return logits

    def finish(self, out: T) -> T:
        """Mark ``out`` as the graph's output and close the graph."""
        self.out = self.g.output(out)
        self.g.expand(out)
        return out


def _set(g: lib.Ggml, t: T, data: np.ndarray) -> None:
    """Copy ``data`` into input ``t``; the byte counts must agree exactly (checked, never trusted)."""
    nbytes = int(g.ggml_nbytes(t.p))
    if data.nbytes != nbytes or not data.flags.c_contiguous:
        raise ValueError(f"input of {data.nbytes} bytes for a tensor of {nbytes}")
    g.ggml_backend_tensor_set(t.p, ctypes.c_void_p(data.ctypes.data), 0, nbytes)


def read(g: lib.Ggml, t: T) -> np.ndarray:
    """A f32 tensor [ne0, ne1] as a new numpy array of shape (ne1, ne0)."""
    ne0, ne1 = t.ne[0], t.ne[1]
    out = np.empty((ne1, ne0), np.float32)
    if t.type != lib.F32 or int(g.ggml_nbytes(t.p)) != out.nbytes:
        raise ValueError(f"cannot read {t} as f32 [{ne1}, {ne0}]")
    g.ggml_backend_tensor_get(t.p, ctypes.c_void_p(out.ctypes.data), 0, out.nbytes)
    return out
