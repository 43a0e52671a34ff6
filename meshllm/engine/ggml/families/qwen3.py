"""Qwen 3 dense (``src/models/qwen3.cpp``): the llama block with per-head RMS norms on q and k before rope.

Rope rotates halves (GPT-NeoX). The attention half is shared with Qwen 3 MoE (:mod:`.qwen3moe`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from meshllm.engine.ggml.families.llama import residual_block
from meshllm.engine.ggml.family import ATTENTION, DENSE_FFN, QK_NORM, Family
from meshllm.engine.ggml.hparams import HParams

if TYPE_CHECKING:
    from meshllm.engine.ggml.blocks import Step
    from meshllm.engine.ggml.graph import T
    from meshllm.engine.ggml.weights import LayerWeights


def attention(s: Step, lw: LayerWeights, slot: int, x: T) -> T:
    """Norm, q/k/v (+ biases), per-head q/k norms (when the layer has them), rope, attention, output projection."""
    g, hp, n, il = s.g, s.hp, s.n, lw.index
    cur = s.norm(x, lw["attn_norm.weight"])
    q = g.reshape(s.linear(cur, lw["attn_q.weight"], lw.get("attn_q.bias")), hp.head_dim, hp.n_heads, n)
    k = g.reshape(s.linear(cur, lw["attn_k.weight"], lw.get("attn_k.bias")), hp.head_dim, hp.n_kv_heads, n)
    v = g.reshape(s.linear(cur, lw["attn_v.weight"], lw.get("attn_v.bias")), hp.head_dim, hp.n_kv_heads, n)
    q_norm, k_norm = lw.get("attn_q_norm.weight"), lw.get("attn_k_norm.weight")  # optional for GLM-4.5
    q = s.rope(s.norm(q, q_norm) if q_norm is not None else q, il, None)
    k = s.rope(s.norm(k, k_norm) if k_norm is not None else k, il, None)
    cur = s.attention(slot, il, q, k, v, hp.attn_scale)
    return s.linear(cur, lw["attn_output.weight"], lw.get("attn_output.bias"))


def block(s: Step, lw: LayerWeights, slot: int, x: T) -> T:
    return residual_block(s, lw, x, attention(s, lw, slot, x))


def tensors(_hp: HParams, _il: int) -> tuple[tuple[str, ...], tuple[str, ...]]:
    return (*ATTENTION, *QK_NORM, *DENSE_FFN), ()


FAMILY = Family(arch="qwen3", examples="Qwen3 0.6B to 32B", block=block, layer_tensors=tensors, neox_rope=True)
