"""Phi-3 / Phi-4 (``src/models/phi3.cpp``): fused projections, queries pre-scaled.

q, k and v come from one fused ``attn_qkv`` matrix (or three separate ones), rope rotates halves,
queries are scaled by 1/sqrt(head size) before the attention (which then scales by 1), and the FFN's
``ffn_up`` holds gate and up side by side (a fused SwiGLU). llama.cpp ignores Phi's sliding window, and
so does this; LongRoPE factors (the 128k-context variants) are refused.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from meshllm.engine.ggml.family import Family, standard_shapes
from meshllm.engine.ggml.hparams import HParams

if TYPE_CHECKING:
    from meshllm.engine.ggml.blocks import Step
    from meshllm.engine.ggml.graph import T
    from meshllm.engine.ggml.weights import LayerWeights


def block(s: Step, lw: LayerWeights, slot: int, x: T) -> T:
    g, hp, n, il = s.g, s.hp, s.n, lw.index
    cur = s.norm(x, lw["attn_norm.weight"])
    fused = lw.get("attn_qkv.weight")
    if fused is not None:
        qkv = s.linear(cur, fused)
        elt, q_width, kv_width = qkv.nb[0], hp.n_heads * hp.head_dim, hp.n_kv_heads * hp.head_dim
        strides = (elt * hp.head_dim, qkv.nb[1])
        q = g.view(qkv, (hp.head_dim, hp.n_heads, n), strides)
        k = g.view(qkv, (hp.head_dim, hp.n_kv_heads, n), strides, elt * q_width)
        v = g.cont(g.view(qkv, (hp.head_dim, hp.n_kv_heads, n), strides, elt * (q_width + kv_width)))
    else:
        q = g.reshape(s.linear(cur, lw["attn_q.weight"]), hp.head_dim, hp.n_heads, n)
        k = g.reshape(s.linear(cur, lw["attn_k.weight"]), hp.head_dim, hp.n_kv_heads, n)
        v = g.reshape(s.linear(cur, lw["attn_v.weight"]), hp.head_dim, hp.n_kv_heads, n)
    q = g.scale(s.rope(q, il, None), hp.attn_scale)
    k = s.rope(k, il, None)
    cur = s.linear(s.attention(slot, il, q, k, v, 1.0), lw["attn_output.weight"], lw.get("attn_output.bias"))
    cur, x = s.output_rows(il, cur, x)
    residual = g.add(cur, x)
    cur = s.norm(residual, lw["ffn_norm.weight"])
    cur = s.linear(g.swiglu_fused(s.linear(cur, lw["ffn_up.weight"])), lw["ffn_down.weight"])
    return g.add(residual, cur)


def tensors(_hp: HParams, _il: int) -> tuple[tuple[str, ...], tuple[str, ...]]:
    # either the fused q/k/v matrix or the three; the block uses whichever the file has
    return ("attn_norm.weight", "attn_output.weight", "ffn_norm.weight", "ffn_up.weight", "ffn_down.weight"), (
        "attn_qkv.weight", "attn_q.weight", "attn_k.weight", "attn_v.weight", "attn_output.bias")


def check(names: set[str]) -> str | None:
    separate = {"attn_q.weight", "attn_k.weight", "attn_v.weight"} & names
    if ("attn_qkv.weight" in names) == bool(separate) or (separate and len(separate) != 3):
        return "needs either attn_qkv.weight or all of attn_q/attn_k/attn_v.weight"
    return None


def shapes(hp: HParams) -> dict[str, tuple[int, ...]]:
    q, kv = hp.n_heads * hp.head_dim, hp.n_kv_heads * hp.head_dim
    return {**standard_shapes(hp), "attn_qkv.weight": (hp.width, q + 2 * kv), "ffn_up.weight": (hp.width, 2 * hp.ffn)}


FAMILY = Family(arch="phi3", examples="Phi-3 mini/medium, Phi-3.5 mini, Phi-4, Phi-4 mini", block=block,
                layer_tensors=tensors, neox_rope=True, shapes=shapes, check_layer=check)
