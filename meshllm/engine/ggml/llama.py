"""One block of the llama family (LLaMA, Mistral, SmolLM, Qwen2) as llama.cpp builds it.

Pre-norm attention and a SwiGLU FFN, each added to the residual stream (``src/models/llama.cpp`` and
``qwen2.cpp``). Qwen2's q/k/v biases, and any optional bias a llama GGUF carries, are added after
their projections. Rope rotates adjacent pairs for ``llama`` (the converter permuted q/k for that)
and halves for ``qwen2``; llama 3's ``rope_freqs`` factors apply to ``llama`` only, as in llama.cpp.
"""

from __future__ import annotations

from meshllm.engine.ggml.blocks import Step
from meshllm.engine.ggml.graph import T
from meshllm.engine.ggml.weights import LayerWeights


def block(s: Step, lw: LayerWeights, slot: int, x: T) -> T:
    """Run layer ``lw`` on activations ``x`` [width, n]; its K/V go to cache layer ``slot``."""
    g, hp, n, il = s.g, s.hp, s.n, lw.index
    residual = x
    cur = s.norm(x, lw["attn_norm.weight"])
    q = s.linear(cur, lw["attn_q.weight"], lw.get("attn_q.bias"))
    k = s.linear(cur, lw["attn_k.weight"], lw.get("attn_k.bias"))
    v = s.linear(cur, lw["attn_v.weight"], lw.get("attn_v.bias"))
    q = g.reshape(q, hp.head_dim, hp.n_heads, n)
    k = g.reshape(k, hp.head_dim, hp.n_kv_heads, n)
    v = g.reshape(v, hp.head_dim, hp.n_kv_heads, n)
    factors = s.w.rope_freqs if hp.arch == "llama" else None
    q = s.rope(q, il, factors)
    k = s.rope(k, il, factors)
    cur = s.attention(slot, il, q, k, v, hp.attn_scale)
    cur = s.linear(cur, lw["attn_output.weight"], lw.get("attn_output.bias"))
    cur, residual = s.output_rows(il, cur, residual)
    ffn_in = g.add(cur, residual)
    cur = s.norm(ffn_in, lw["ffn_norm.weight"])
    up = s.linear(cur, lw["ffn_up.weight"], lw.get("ffn_up.bias"))
    gate = s.linear(cur, lw["ffn_gate.weight"], lw.get("ffn_gate.bias"))
    cur = s.linear(g.glu("silu", gate, up), lw["ffn_down.weight"], lw.get("ffn_down.bias"))
    return g.add(cur, ffn_in)
