"""Building blocks shared by the model families: norms, activations, the fused QKV split, attention.

Everything is float32 and works on a batch of ``n`` consecutive tokens, so one code path serves both
batched prefill (n = prompt length) and one-token decode (n = 1).
"""

from __future__ import annotations

import numpy as np

from meshllm.engine.numpy.hparams import HParams

_SQRT_2_OVER_PI = np.float32(0.7978845608028654)


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """``x / rms(x) * weight`` over the last axis (the weight is used as stored; see docs/engine.md)."""
    ms = np.mean(np.square(x), axis=-1, keepdims=True)
    return x * (1.0 / np.sqrt(ms + np.float32(eps))) * weight


def silu(x: np.ndarray) -> np.ndarray:
    """``x * sigmoid(x)``; large negative inputs overflow exp harmlessly to a zero result."""
    with np.errstate(over="ignore"):
        return x / (1.0 + np.exp(-x))


def gelu_tanh(x: np.ndarray) -> np.ndarray:
    """GELU with the tanh approximation, as Gemma and ggml's ``gelu`` use."""
    return 0.5 * x * (1.0 + np.tanh(_SQRT_2_OVER_PI * x * (1.0 + np.float32(0.044715) * x * x)))


def linear(x: np.ndarray, w: np.ndarray, b: np.ndarray | None) -> np.ndarray:
    """``x @ w (+ b)`` for a [in, out] weight."""
    y = x @ w
    if b is not None:
        y += b
    return y


def split_qkv(qkv: np.ndarray, hp: HParams) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Views of a fused projection as q [n, heads, d], k and v [n, kv_heads, d]."""
    n, d = qkv.shape[0], hp.head_dim
    q_end = hp.n_heads * d
    k_end = q_end + hp.n_kv_heads * d
    q = qkv[:, :q_end].reshape(n, hp.n_heads, d)
    k = qkv[:, q_end:k_end].reshape(n, hp.n_kv_heads, d)
    v = qkv[:, k_end:].reshape(n, hp.n_kv_heads, d)
    return q, k, v


def attention(q: np.ndarray, keys: np.ndarray, values: np.ndarray, pos0: int, window: int) -> np.ndarray:
    """Causal (optionally sliding-window) grouped-query attention of already scaled queries.

    ``q`` is [n, heads, d] for positions pos0 .. pos0+n-1; ``keys``/``values`` are [kv_heads, T, d] for
    positions 0 .. T-1 (T = pos0 + n). Query head h reads KV head h // (heads / kv_heads), as in ggml.
    A sliding-window layer lets position p see keys p-window+1 .. p, so only that tail is read.
    Returns [n, heads * d].
    """
    n, heads, d = q.shape
    kv_heads = keys.shape[0]
    group = heads // kv_heads
    k0 = max(0, pos0 - window + 1) if window else 0
    keys, values = keys[:, k0:], values[:, k0:]
    t = keys.shape[1]
    qg = q.transpose(1, 0, 2).reshape(kv_heads, group * n, d)
    scores = qg @ keys.transpose(0, 2, 1)
    if n > 1:
        qpos = np.arange(pos0, pos0 + n)[:, None]
        kpos = np.arange(k0, k0 + t)[None, :]
        hidden = kpos > qpos
        if window:
            hidden |= qpos - kpos >= window
        scores.reshape(kv_heads, group, n, t)[:, :, hidden] = -np.inf
    scores -= scores.max(axis=-1, keepdims=True)
    np.exp(scores, out=scores)
    scores /= scores.sum(axis=-1, keepdims=True)
    out = scores @ values
    return out.reshape(heads, n, d).transpose(1, 0, 2).reshape(n, heads * d)
