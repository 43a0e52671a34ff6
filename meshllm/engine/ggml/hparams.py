"""Hyperparameters of a GGUF model, read from its metadata and checked against what we implement.

Everything the forward pass needs is decided here, once, from the GGUF keys llama.cpp itself reads,
with llama.cpp's defaults where a key is absent, so that our output matches llama.cpp on the same file.
The keys every family shares are read here; a family's own (its scales, sliding-window layout,
soft-capping) are read by its module in :mod:`meshllm.engine.ggml.families`, which also decides
whether the architecture is supported at all. An unknown architecture or an unimplemented feature
(an unknown rope scaling type, differing head counts per layer, ...) raises :class:`UnsupportedModel`
here, before any tensor data is touched.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from meshllm.engine.ggml.errors import UnsupportedModel
from meshllm.models.gguf_file import GGUFFile

_MISSING = object()


@dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding of one kind of layer, in the terms of ggml's ``rope_ext``."""

    neox: bool
    """Rotate halves (GPT-NeoX) instead of adjacent pairs (original LLaMA layout)."""
    n_rot: int
    """How many leading dimensions of each head are rotated."""
    freq_base: float
    """Theta base: dimension pair i turns at ``freq_base ** (-2 i / n_rot)`` radians per position."""
    freq_scale: float
    """Position interpolation factor (1 / rope scaling factor)."""
    ext_factor: float = 0.0
    """YaRN extrapolation mix; 0 disables YaRN."""
    attn_factor: float = 1.0
    """Magnitude scale applied to cos and sin (YaRN's attention temperature)."""
    beta_fast: float = 32.0
    """YaRN: rotations at which the ramp between interpolation and extrapolation starts."""
    beta_slow: float = 1.0
    """YaRN: rotations at which that ramp ends."""
    n_ctx_orig: int = 0
    """YaRN: the context length the model was trained on."""
    yarn_log_mul: float = 0.0
    """DeepSeek's YaRN: ``mscale_all_dim`` (the GGUF's ``yarn_log_multiplier`` / 0.1, as llama.cpp reads it)."""


@dataclass(frozen=True)
class HParams:
    """The shape and numerics of a supported model; see the module docstring for where they come from."""

    arch: str
    n_layers: int
    width: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    ffn: int
    vocab: int
    rms_eps: float
    context_length: int
    attn_scale: float
    """Multiplies q.k before the softmax."""
    embed_scale: float
    """Multiplies token embeddings (Gemma: sqrt(width))."""
    final_logit_softcap: float
    """``c * tanh(logits / c)`` when non-zero (Gemma 2 style); 0 when absent."""
    rope: RopeConfig
    """Rotary embedding of global (full attention) layers."""
    rope_swa: RopeConfig
    """Rotary embedding of sliding-window layers (Gemma 3's local layers have their own base)."""
    sliding_window: int
    """Window of sliding-window layers in tokens; 0 when the model has none."""
    swa_layers: tuple[bool, ...]
    """Per layer: does it attend only within the sliding window?"""
    logit_scale: float = 1.0
    """The logits are divided by it (Granite)."""
    residual_scale: float = 0.0
    """Multiplies each branch's output before its residual add when non-zero (Granite)."""
    attn_softcap: float = 0.0
    """``c * tanh(scores / c)`` on attention scores before the softmax when non-zero (Gemma 2)."""
    n_expert: int = 0
    """Experts per mixture-of-experts layer; 0 for a dense model."""
    n_expert_used: int = 0
    """Experts each token is routed to."""
    expert_ffn: int = 0
    """Hidden size of one expert's FFN."""
    expert_gating: Literal["softmax", "sigmoid", "softmax_weight"] = "softmax"
    """How router logits become expert weights: ``softmax`` or ``sigmoid`` of all, or ``softmax_weight``
    (select on the logits, softmax over the chosen ones)."""
    shared_ffn: int = 0
    """Hidden size of the shared expert FFN every token runs beside its chosen experts; 0 for none."""
    n_dense_lead: int = 0
    """Leading layers with a dense FFN before the mixture-of-experts layers (GLM-4.5, DeepSeek)."""
    moe_step: int = 1
    """From ``n_dense_lead`` on, layer ``il`` has experts when ``(il + 1) % moe_step == 0`` (ERNIE 4.5)."""
    expert_act: Literal["swiglu", "swiglu_oai"] = "swiglu"
    """The experts' activation: ``swiglu``, or gpt-oss's clamped ``swiglu_oai``."""
    expert_groups: tuple[int, int] = (0, 0)
    """Expert-group routing (DeepSeek V3): experts in ``[0]`` groups, each token choosing among the
    experts of its ``[1]`` best groups (a group scored by its two best experts); (0, 0) for none."""
    expert_norm: bool = False
    """Renormalise the chosen experts' weights to sum to 1."""
    expert_scale: float = 1.0
    """Multiplies the chosen experts' weights (after any renormalisation)."""

    v_head_dim: int = 0
    """Width of a value head when it differs from ``head_dim`` (DeepSeek); 0: the same."""
    q_lora: int = 0
    """DeepSeek: rank of the low-rank query projection; 0 for a direct ``attn_q``."""
    kv_lora: int = 0
    """DeepSeek: rank of the compressed KV (the latent ``attn_kv_a_mqa`` projects to)."""
    mixed_kv_widths: bool = False
    """Whether the family reads key and value heads of different widths (else they are refused)."""
    v_in_k: bool = False
    """Values are the leading ``head_dim_v`` dimensions of the cached keys (DeepSeek's absorbed MLA):
    the cache keeps no V."""

    mla_head_dims: tuple[int, int] = (0, 0)
    """DeepSeek's absorbed layout: the query head and value head widths before absorption."""

    @property
    def q_head_dim(self) -> int:
        """Width of one query head as the projections give it (DeepSeek absorbed: before absorption)."""
        return self.mla_head_dims[0] or self.head_dim

    @property
    def out_head_dim(self) -> int:
        """Width of one head of the attention's output."""
        return self.mla_head_dims[1] or self.head_dim_v

    @property
    def head_dim_v(self) -> int:
        """Width of one value head."""
        return self.v_head_dim or self.head_dim

    @property
    def k_width(self) -> int:
        """Elements of one token's keys in a layer's cache."""
        return self.n_kv_heads * self.head_dim

    @property
    def v_width(self) -> int:
        """Elements of one token's values in a layer's cache (0: none kept, they are read from K)."""
        return 0 if self.v_in_k else self.n_kv_heads * self.head_dim_v

    def has_experts(self, layer: int) -> bool:
        """Whether ``layer`` routes to experts (a dense model: never)."""
        return bool(self.n_expert) and layer >= self.n_dense_lead and (layer + 1) % self.moe_step == 0

    def rope_for(self, layer: int) -> RopeConfig:
        """The rotary embedding layer ``layer`` uses."""
        return self.rope_swa if self.swa_layers[layer] else self.rope

    def window_for(self, layer: int) -> int:
        """The attention window of ``layer`` in tokens, 0 for unlimited."""
        return self.sliding_window if self.swa_layers[layer] else 0


def f32_sqrt(x: float) -> float:
    """``sqrtf(x)``: llama.cpp computes its scales in float32, and so must we to match it bit for bit."""
    return float(np.sqrt(np.float32(x)))


def f32_div(a: float, b: float) -> float:
    return float(np.float32(a) / np.float32(b))


def metadata(reader: GGUFFile, key: str, default: Any = _MISSING) -> Any:
    """The value of metadata ``key``, ``default`` if absent; a missing required key is refused."""
    value = reader.fields.get(key, default)
    if value is _MISSING:
        raise UnsupportedModel(f"GGUF metadata lacks the required key {key!r}")
    return value


def number(reader: GGUFFile, key: str, kind: type, default: Any = _MISSING) -> Any:
    """``key`` as an ``int`` or ``float``; a value of another type (a string, an array) is refused."""
    value = metadata(reader, key, default)
    if isinstance(value, bool) or not isinstance(value, int | float) or (kind is int and not isinstance(value, int)):
        raise UnsupportedModel(f"GGUF key {key!r} is {value!r}, expected a number")
    if not math.isfinite(value):
        raise UnsupportedModel(f"GGUF key {key!r} is {value}")
    return kind(value)


def count(reader: GGUFFile, key: str, default: Any = _MISSING, *, minimum: int = 1) -> int:
    """A positive count (layers, heads, widths), possibly given per layer; per-layer values must agree."""
    value = metadata(reader, key, default)
    if isinstance(value, list):
        if not value or len(set(value)) != 1:
            raise UnsupportedModel(f"{key} differs between layers ({sorted(set(value))}); not implemented")
        value = value[0]
    if isinstance(value, bool) or not isinstance(value, int) or not minimum <= value <= 1 << 24:
        raise UnsupportedModel(f"GGUF key {key!r} is {value!r}, expected a count >= {minimum}")
    return value


def rope_config(reader: GGUFFile, arch: str, n_rot: int, context: int, *, neox: bool) -> RopeConfig:
    """The rope settings of global layers, resolved the way llama.cpp's context setup does."""
    a = arch
    scaling = str(metadata(reader, f"{a}.rope.scaling.type", "linear"))
    if scaling not in ("none", "linear", "yarn"):
        raise UnsupportedModel(f"rope scaling type {scaling!r} is not implemented (none, linear, yarn are)")
    factor = number(reader, f"{a}.rope.scaling.factor", float, 0.0) or number(
        reader, f"{a}.rope.scale_linear", float, 0.0)
    if factor < 0:
        raise UnsupportedModel(f"rope scaling factor {factor} is negative")
    freq_scale = 1.0 if scaling == "none" or factor == 0.0 else f32_div(1.0, factor)
    attn_factor = number(reader, f"{a}.rope.scaling.attn_factor", float, 1.0)
    ext_factor = 0.0
    log_mul = number(reader, f"{a}.rope.scaling.yarn_log_multiplier", float, 0.0)
    if log_mul and arch != "deepseek2":
        raise UnsupportedModel(f"YaRN with a log multiplier is implemented for deepseek2 only, not {arch}")
    log_mul = float(np.float32(log_mul) / np.float32(0.1))  # the converter's factor, cancelled as llama.cpp does
    if scaling == "yarn":
        ext_factor = 1.0
        f = 1.0 / freq_scale
        mscale = 1.0 if f <= 1.0 else 0.1 * math.log(f) + 1.0
        if log_mul:  # DeepSeek: llama.cpp takes mscale = mscale_all_dim, so their ratio is 1; in float32
            one = np.float32(1.0)
            cancel = one / (one + np.float32(0.1) * np.log(one / np.float32(freq_scale)))
            attn_factor = float(one * cancel * np.float32(attn_factor))
        else:  # llama.cpp cancels the magnitude factor its rope kernel applies again for YaRN.
            attn_factor *= mscale / (1.0 + 0.1 * math.log(f))
    base = number(reader, f"{a}.rope.freq_base", float, 10000.0)
    if base <= 0:
        raise UnsupportedModel(f"rope freq_base {base} is not positive")
    return RopeConfig(
        neox=neox, n_rot=n_rot, freq_base=base, freq_scale=freq_scale, ext_factor=ext_factor,
        attn_factor=attn_factor, beta_fast=number(reader, f"{a}.rope.scaling.yarn_beta_fast", float, 32.0),
        beta_slow=number(reader, f"{a}.rope.scaling.yarn_beta_slow", float, 1.0),
        n_ctx_orig=count(reader, f"{a}.rope.scaling.original_context_length", context), yarn_log_mul=log_mul,
    )


def swa_layers(reader: GGUFFile, arch: str, n_layers: int, window: int, pattern: int) -> tuple[bool, ...]:
    """Which layers attend within the sliding window, llama.cpp's ``set_swa_pattern``.

    ``pattern`` n (the family's default, or the GGUF's ``sliding_window_pattern``): every n-th layer
    is global, the n-1 before it local; 0 makes every layer local. The GGUF may also list a flag per layer.
    """
    if window <= 0:
        return (False,) * n_layers
    key = f"{arch}.attention.sliding_window_pattern"
    given = metadata(reader, key, pattern)
    if isinstance(given, list):
        if len(given) < n_layers:
            raise UnsupportedModel(f"sliding_window_pattern has {len(given)} entries for {n_layers} layers")
        return tuple(bool(p) for p in given[:n_layers])
    n = count(reader, key, pattern, minimum=0)
    return tuple(n == 0 or il % n < n - 1 for il in range(n_layers))


def read_hparams(reader: GGUFFile) -> HParams:
    """Read and validate the hyperparameters of the GGUF behind ``reader``.

    The architecture's family (:func:`~meshllm.engine.ggml.families.family_for`) refuses an
    unsupported one, then adds what only it reads to the keys read here.
    """
    from meshllm.engine.ggml.families import family_for  # the families read their keys with this module

    arch = str(metadata(reader, "general.architecture"))
    family = family_for(arch)
    a = arch
    n_layers = count(reader, f"{a}.block_count")
    width = count(reader, f"{a}.embedding_length")
    n_heads = count(reader, f"{a}.attention.head_count")
    n_kv_heads = count(reader, f"{a}.attention.head_count_kv", n_heads)
    ffn = count(reader, f"{a}.feed_forward_length")
    head_dim = count(reader, f"{a}.attention.key_length", max(1, width // n_heads))
    v_head_dim = count(reader, f"{a}.attention.value_length", max(1, width // n_heads))
    if n_heads % n_kv_heads:
        raise UnsupportedModel(f"{n_heads} query heads cannot be grouped over {n_kv_heads} KV heads")
    n_rot = count(reader, f"{a}.rope.dimension_count", head_dim)
    if n_rot > head_dim or n_rot % 2:
        raise UnsupportedModel(f"rope dimension count {n_rot} does not fit head size {head_dim}")
    context = count(reader, f"{a}.context_length")
    embd = reader.tensor("token_embd.weight")
    if embd is None or len(embd.shape) != 2 or embd.shape[0] != width:
        raise UnsupportedModel(f"GGUF has no token_embd.weight of width {width}")
    rope = rope_config(reader, arch, n_rot, context, neox=family.neox_rope)
    n_expert = count(reader, f"{a}.expert_count", 0, minimum=0)
    n_expert_used = count(reader, f"{a}.expert_used_count", 0, minimum=0)
    if n_expert and not 0 < n_expert_used <= n_expert:
        raise UnsupportedModel(f"{n_expert_used} experts used per token out of {n_expert}")
    hp = HParams(
        arch=arch,
        n_layers=n_layers,
        width=width,
        n_heads=n_heads,
        n_kv_heads=n_kv_heads,
        head_dim=head_dim,
        ffn=ffn,
        vocab=embd.shape[1],
        rms_eps=number(reader, f"{a}.attention.layer_norm_rms_epsilon", float),
        context_length=context,
        attn_scale=f32_div(1.0, f32_sqrt(head_dim)),
        embed_scale=1.0,
        final_logit_softcap=0.0,
        rope=rope,
        rope_swa=rope,
        sliding_window=0,
        swa_layers=(False,) * n_layers,
        n_expert=n_expert,
        n_expert_used=n_expert_used if n_expert else 0,
        expert_ffn=count(reader, f"{a}.expert_feed_forward_length", ffn) if n_expert else 0,
        expert_scale=number(reader, f"{a}.expert_weights_scale", float, 1.0) or 1.0,
        v_head_dim=v_head_dim if v_head_dim != head_dim else 0,
    )
    hp = family.hparams(reader, hp)
    if hp.head_dim_v != hp.head_dim and not hp.mixed_kv_widths:
        raise UnsupportedModel(f"key length {hp.head_dim} != value length {hp.head_dim_v}; not implemented")
    return hp
