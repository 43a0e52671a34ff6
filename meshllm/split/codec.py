"""Activation codecs for stage lanes: float32 (default), float16 and int8 with one scale per row.

Activations are a float32 ``[n_tokens, width]`` array on both sides; the codec only decides what
crosses the wire. float16 halves the bytes at ~1e-3 relative error; int8-per-row (a float32 scale
per token row, then ``width`` int8 values, the idea behind distributed-llama's Q80) cuts them to
about a quarter at ~1% error. Stages always compute from float32 (the residual stream ggml keeps).
Sizes are exact functions of the shape, so a receiver checks ``len(payload)`` before decoding.
"""

from __future__ import annotations

from typing import Literal

import numpy as np

from meshllm.split.errors import BadFrame

Dtype = Literal["f32", "f16", "i8"]
DTYPES: tuple[Dtype, ...] = ("f32", "f16", "i8")


def encoded_size(dtype: str, n_tokens: int, width: int) -> int:
    """Exact payload bytes of ``n_tokens`` rows of ``width`` activations in ``dtype``."""
    if dtype == "f32":
        return 4 * n_tokens * width
    if dtype == "f16":
        return 2 * n_tokens * width
    if dtype == "i8":
        return n_tokens * (4 + width)
    raise BadFrame(f"unknown activation dtype {dtype!r}; expected one of {', '.join(DTYPES)}", code="bad-dtype")


def encode(x: np.ndarray, dtype: str) -> bytes:
    """Wire bytes of float32 activations ``x`` [n, width] in ``dtype``."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    if x.ndim != 2:
        raise ValueError(f"activations must be 2-D, got shape {x.shape}")
    if dtype == "f32":
        return x.tobytes()
    if dtype == "f16":
        return x.astype(np.float16).tobytes()
    if dtype == "i8":
        peak = np.abs(x).max(axis=1)
        scale = np.where(peak > 0, peak / 127.0, 1.0).astype(np.float32)
        q = np.clip(np.rint(x / scale[:, None]), -127, 127).astype(np.int8)
        return scale.tobytes() + q.tobytes()
    raise ValueError(f"unknown activation dtype {dtype!r}")


def decode(payload: bytes, dtype: str, n_tokens: int, width: int) -> np.ndarray:
    """float32 activations [n_tokens, width] from wire bytes; :class:`BadFrame` on a size or value mismatch."""
    expected = encoded_size(dtype, n_tokens, width)
    if len(payload) != expected:
        raise BadFrame(
            f"{dtype} activations of shape [{n_tokens}, {width}] take {expected} bytes, got {len(payload)}",
            code="bad-size",
        )
    if dtype == "f32":
        x = np.frombuffer(payload, dtype=np.float32).reshape(n_tokens, width).copy()
    elif dtype == "f16":
        x = np.frombuffer(payload, dtype=np.float16).reshape(n_tokens, width).astype(np.float32)
    else:
        scale = np.frombuffer(payload, dtype=np.float32, count=n_tokens)
        q = np.frombuffer(payload, dtype=np.int8, offset=4 * n_tokens).reshape(n_tokens, width)
        x = q.astype(np.float32) * scale[:, None]
    if not np.isfinite(x).all():
        raise BadFrame("activations contain NaN or infinity", code="bad-values")
    return x
