"""One block of Gemma 3 (the default model) as llama.cpp builds it (``src/models/gemma3.cpp``).

Differences from the llama family: RMS norms on q and k per head before rope, queries pre-scaled by
the attention scale (the attention itself then scales by 1), norms after attention and after the FFN
(before each residual add), a GELU-gated FFN, and alternating sliding-window (local) and global
layers, each kind with its own rope base (:meth:`HParams.rope_for`) and mask. Norm weights are used
as stored: llama.cpp's converter already added Gemma's ``1 +``. Embeddings are scaled by
``sqrt(width)`` on the first stage (:attr:`HParams.embed_scale`).
"""

from __future__ import annotations

from meshllm.engine.ggml.blocks import Step
from meshllm.engine.ggml.graph import T
from meshllm.engine.ggml.weights import LayerWeights


def block(s: Step, lw: LayerWeights, slot: int, x: T) -> T:
    """Run layer ``lw`` on activations ``x`` [width, n]; its K/V go to cache layer ``slot``."""
    g, hp, n, il = s.g, s.hp, s.n, lw.index
    cur = s.norm(x, lw["attn_norm.weight"])
    q = g.reshape(s.linear(cur, lw["attn_q.weight"]), hp.head_dim, hp.n_heads, n)
    k = g.reshape(s.linear(cur, lw["attn_k.weight"]), hp.head_dim, hp.n_kv_heads, n)
    v = g.reshape(s.linear(cur, lw["attn_v.weight"]), hp.head_dim, hp.n_kv_heads, n)
    q = s.rope(s.norm(q, lw["attn_q_norm.weight"]), il, None)
    k = s.rope(s.norm(k, lw["attn_k_norm.weight"]), il, None)
    q = g.scale(q, hp.attn_scale)
    cur = s.attention(slot, il, q, k, v, 1.0)
    cur = s.linear(cur, lw["attn_output.weight"])
    cur, x = s.output_rows(il, cur, x)
    sa_out = g.add(s.norm(cur, lw["post_attention_norm.weight"]), x)
    cur = s.norm(sa_out, lw["ffn_norm.weight"])
    up = s.linear(cur, lw["ffn_up.weight"])
    gate = s.linear(cur, lw["ffn_gate.weight"])
    cur = s.linear(g.glu("gelu", gate, up), lw["ffn_down.weight"])
    return g.add(s.norm(cur, lw["post_ffw_norm.weight"]), sa_out)
