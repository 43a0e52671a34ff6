"""Rotary position embeddings as ggml's ``rope_ext`` computes them (plain, linear scaling, YaRN).

ggml turns dimension pair ``i`` of a head at position ``p`` by ``theta = p * base^(-2i/n_rot) / ff_i``
(``ff`` being llama 3's optional ``rope_freqs`` factors), then mixes interpolated and extrapolated
angles for YaRN. All of that is linear in ``p``, so each pair gets one effective frequency, computed
once per layer kind; a forward call then needs only ``cos``/``sin`` of ``positions x frequencies``.
"""

from __future__ import annotations

import math

import numpy as np

from meshllm.engine.numpy.hparams import RopeConfig


def _yarn_corr_dim(n_rot: int, n_ctx_orig: int, rotations: float, base: float) -> float:
    """The dimension at which a pair completes ``rotations`` turns over the original context."""
    return n_rot * math.log(n_ctx_orig / (rotations * 2 * math.pi)) / (2 * math.log(base))


class Rope:
    """Precomputed frequencies for one :class:`RopeConfig`; applies the rotation to q or k in place."""

    def __init__(self, cfg: RopeConfig, freq_factors: np.ndarray | None = None) -> None:
        self.cfg = cfg
        half = cfg.n_rot // 2
        i = np.arange(half, dtype=np.float64)
        extrap = cfg.freq_base ** (-2.0 * i / cfg.n_rot)
        if freq_factors is not None:
            extrap = extrap / freq_factors.astype(np.float64)
        interp = cfg.freq_scale * extrap
        mscale = cfg.attn_factor
        if cfg.ext_factor != 0.0:
            low = max(0.0, math.floor(_yarn_corr_dim(cfg.n_rot, cfg.n_ctx_orig, cfg.beta_fast, cfg.freq_base)))
            high = min(
                cfg.n_rot - 1.0, math.ceil(_yarn_corr_dim(cfg.n_rot, cfg.n_ctx_orig, cfg.beta_slow, cfg.freq_base))
            )
            ramp = 1.0 - np.clip((i - low) / max(0.001, high - low), 0.0, 1.0)
            mix = ramp * cfg.ext_factor
            interp = interp * (1.0 - mix) + extrap * mix
            mscale *= 1.0 + 0.1 * math.log(1.0 / cfg.freq_scale)
        self._freqs = interp
        self._mscale = mscale

    def tables(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``cos`` and ``sin`` tables of shape [n, 1, n_rot/2] for the given absolute positions."""
        theta = positions.astype(np.float64)[:, None] * self._freqs[None, :]
        cos = (np.cos(theta) * self._mscale).astype(np.float32)[:, None, :]
        sin = (np.sin(theta) * self._mscale).astype(np.float32)[:, None, :]
        return cos, sin

    def apply(self, x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> None:
        """Rotate ``x`` of shape [n, heads, head_dim] in place with tables from :meth:`tables`."""
        n_rot = self.cfg.n_rot
        if self.cfg.neox:
            a = x[..., : n_rot // 2]
            b = x[..., n_rot // 2 : n_rot]
        else:
            a = x[..., 0:n_rot:2]
            b = x[..., 1:n_rot:2]
        a_rot = a * cos - b * sin
        b[...] = a * sin + b * cos
        a[...] = a_rot
