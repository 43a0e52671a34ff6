"""One transformer block of the llama family (LLaMA, Mistral, SmolLM, Qwen2).

Pre-norm attention and SwiGLU FFN, each added to the residual stream. Qwen2's q/k/v biases (and any
optional bias a llama GGUF carries) are part of the fused projections. Rope is adjacent-pair for llama
and half-split for qwen2; :class:`Rope` knows which.
"""

from __future__ import annotations

import numpy as np

from meshllm.engine.numpy.hparams import HParams
from meshllm.engine.numpy.kv_cache import KVCache
from meshllm.engine.numpy.layers import attention, linear, rms_norm, silu, split_qkv
from meshllm.engine.numpy.rope import Rope
from meshllm.engine.numpy.weights import LayerWeights


def block(
    x: np.ndarray,
    lw: LayerWeights,
    hp: HParams,
    rope: Rope,
    tables: tuple[np.ndarray, np.ndarray],
    cache: KVCache,
    slot: int,
    window: int,
) -> np.ndarray:
    """Run one block on activations ``x`` [n, width]; writes its K/V into ``cache`` layer ``slot``."""
    pos0 = cache.length
    h = rms_norm(x, lw.attn_norm, hp.rms_eps)
    q, k, v = split_qkv(linear(h, lw.wqkv, lw.bqkv), hp)
    rope.apply(q, *tables)
    rope.apply(k, *tables)
    q *= np.float32(hp.attn_scale)
    keys, values = cache.write(slot, k, v)
    x = x + linear(attention(q, keys, values, pos0, window), lw.wo, lw.bo)
    h = rms_norm(x, lw.ffn_norm, hp.rms_eps)
    gate_up = linear(h, lw.w_gate_up, lw.b_gate_up)
    act = silu(gate_up[:, : hp.ffn]) * gate_up[:, hp.ffn :]
    return x + linear(act, lw.w_down, lw.b_down)
