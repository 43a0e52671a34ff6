"""OLMo 2 (``src/models/olmo2.cpp``): no pre-norms; RMS norms on the whole q and k, and after each half.

q and k are normed over all heads at once (weights of q's and k's full widths) before rope (halves),
the attention output and the SwiGLU FFN's output are each normed before their residual adds. The
sliding-window variant (OLMo 3) is refused.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from meshllm.engine.ggml.errors import UnsupportedModel
from meshllm.engine.ggml.family import Family, standard_shapes
from meshllm.engine.ggml.hparams import HParams, count

if TYPE_CHECKING:
    from meshllm.engine.ggml.blocks import Step
    from meshllm.engine.ggml.graph import T
    from meshllm.engine.ggml.weights import LayerWeights
    from meshllm.models.gguf_file import GGUFFile


def block(s: Step, lw: LayerWeights, slot: int, x: T) -> T:
    g, hp, n, il = s.g, s.hp, s.n, lw.index
    q = s.norm(s.linear(x, lw["attn_q.weight"]), lw["attn_q_norm.weight"])
    k = s.norm(s.linear(x, lw["attn_k.weight"]), lw["attn_k_norm.weight"])
    v = s.linear(x, lw["attn_v.weight"])
    q = s.rope(g.reshape(q, hp.head_dim, hp.n_heads, n), il, None)
    k = s.rope(g.reshape(k, hp.head_dim, hp.n_kv_heads, n), il, None)
    v = g.reshape(v, hp.head_dim, hp.n_kv_heads, n)
    cur = s.linear(s.attention(slot, il, q, k, v, hp.attn_scale), lw["attn_output.weight"])
    cur, x = s.output_rows(il, cur, x)
    ffn_in = g.add(s.norm(cur, lw["post_attention_norm.weight"]), x)
    return g.add(s.norm(s.ffn(ffn_in, lw), lw["post_ffw_norm.weight"]), ffn_in)


def tensors(_hp: HParams, _il: int) -> tuple[tuple[str, ...], tuple[str, ...]]:
    return ("attn_q.weight", "attn_k.weight", "attn_v.weight", "attn_output.weight", "attn_q_norm.weight",
            "attn_k_norm.weight", "post_attention_norm.weight", "ffn_gate.weight", "ffn_up.weight",
            "ffn_down.weight", "post_ffw_norm.weight"), ()


def shapes(hp: HParams) -> dict[str, tuple[int, ...]]:
    return {**standard_shapes(hp), "attn_q_norm.weight": (hp.n_heads * hp.head_dim,),
            "attn_k_norm.weight": (hp.n_kv_heads * hp.head_dim,)}


def read(reader: GGUFFile, hp: HParams) -> HParams:
    if count(reader, f"{hp.arch}.attention.sliding_window", 0, minimum=0):
        raise UnsupportedModel("OLMo 2 with a sliding window (OLMo 3) is not implemented")
    return hp


FAMILY = Family(arch="olmo2", examples="OLMo 2 1B, 7B, 13B, 32B", block=block, layer_tensors=tensors, neox_rope=True,
                hparams=read, shapes=shapes)
