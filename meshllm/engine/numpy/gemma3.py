"""One transformer block of Gemma 3 (the default model), following llama.cpp's gemma3 graph.

Differences from the llama family: RMS norms on q and k per head before rope, norms after attention
and after the FFN (before each residual add), a GELU(tanh)-gated FFN, queries pre-scaled by the
attention scale, and alternating sliding-window (local) and global layers, each kind with its own rope.
Norm weights are used as stored: llama.cpp's converter already added Gemma's ``1 +`` to them.
"""

from __future__ import annotations

import numpy as np

from meshllm.engine.numpy.hparams import HParams
from meshllm.engine.numpy.kv_cache import KVCache
from meshllm.engine.numpy.layers import attention, gelu_tanh, rms_norm, split_qkv
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
    assert lw.q_norm is not None and lw.k_norm is not None
    assert lw.post_attn_norm is not None and lw.post_ffn_norm is not None
    pos0 = cache.length
    eps = hp.rms_eps
    h = rms_norm(x, lw.attn_norm, eps)
    q, k, v = split_qkv(h @ lw.wqkv, hp)
    q = rms_norm(q, lw.q_norm, eps)
    k = rms_norm(k, lw.k_norm, eps)
    rope.apply(q, *tables)
    rope.apply(k, *tables)
    q *= np.float32(hp.attn_scale)
    keys, values = cache.write(slot, k, v)
    attn = attention(q, keys, values, pos0, window) @ lw.wo
    x = x + rms_norm(attn, lw.post_attn_norm, eps)
    h = rms_norm(x, lw.ffn_norm, eps)
    gate_up = h @ lw.w_gate_up
    act = gelu_tanh(gate_up[:, : hp.ffn]) * gate_up[:, hp.ffn :]
    return x + rms_norm(act @ lw.w_down, lw.post_ffn_norm, eps)
