"""Qwen 3.5 dense (``src/models/qwen35.cpp``): gated delta-net (linear attention) layers between attention layers.

A hybrid: by default three of every four layers are recurrent (``full_attention_interval``, or the
GGUF's per-layer ``attention.recurrent_layers``). A recurrent layer projects the normed input to q/k/v
(one ``attn_qkv``) and a gate ``z`` (``attn_gate``), runs q/k/v through a causal convolution
(``ssm_conv1d``) and SiLU, L2-normalises q and k, and folds the tokens into its state with the gated
delta rule (decay ``softplus(alpha + ssm_dt) * ssm_a``, write strength ``sigmoid(beta)``); the output
is RMS-normed per head, gated by ``silu(z)`` and projected by ``ssm_out``. An attention layer is
Qwen 3's with an output gate: ``attn_q`` gives each head's query and a gate side by side, per-head
q/k norms, interleaved multi-section rope (text positions), attention, ``sigmoid(gate)`` times the
result. Every layer then has a post-attention norm and a SwiGLU FFN (Qwen 3.5 MoE: experts,
:mod:`.qwen35moe`). The final layer runs every row; the rows whose logits are wanted are taken after
the output norm, as llama.cpp does for this family.

The recurrent state lives per session beside the KV cache (:mod:`meshllm.engine.ggml.recurrent`).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from meshllm.engine.ggml.errors import UnsupportedModel
from meshllm.engine.ggml.family import DENSE_FFN, QK_NORM, Family, standard_shapes
from meshllm.engine.ggml.hparams import HParams, SsmShape, count, f32_div, f32_sqrt, metadata
from meshllm.models.gguf_file import GGUFFile

if TYPE_CHECKING:
    from collections.abc import Callable

    from meshllm.engine.ggml.blocks import Step
    from meshllm.engine.ggml.graph import T
    from meshllm.engine.ggml.weights import LayerWeights

ATTENTION = ("attn_norm.weight", "attn_q.weight", "attn_k.weight", "attn_v.weight", "attn_output.weight", *QK_NORM)
"""An attention layer's tensors (``attn_q`` is twice as wide: a query and a gate per head)."""
RECURRENT = ("attn_norm.weight", "attn_qkv.weight", "attn_gate.weight", "ssm_conv1d.weight", "ssm_dt.bias", "ssm_a",
             "ssm_beta.weight", "ssm_alpha.weight", "ssm_norm.weight", "ssm_out.weight")
"""A gated delta-net layer's tensors."""


def attention(s: Step, lw: LayerWeights, slot: int, x: T) -> T:
    """The gated attention of a full-attention layer on the normed ``x``."""
    g, hp, n, il = s.g, s.hp, s.n, lw.index
    hd, f = hp.head_dim, 4
    q_full = s.linear(x, lw["attn_q.weight"])  # [2 * head_dim * heads, n]: query, gate per head
    k = s.linear(x, lw["attn_k.weight"])
    v = s.linear(x, lw["attn_v.weight"])
    q = g.view(q_full, (hd, hp.n_heads, n), (f * hd * 2, f * hd * 2 * hp.n_heads))
    q = s.norm(q, lw["attn_q_norm.weight"])
    k = s.norm(g.reshape(k, hd, hp.n_kv_heads, n), lw["attn_k_norm.weight"])
    gate = g.view(q_full, (hd, hp.n_heads, n), (f * hd * 2, f * hd * 2 * hp.n_heads), f * hd)
    gate = g.cont_2d(gate, hd * hp.n_heads, n)
    v = g.reshape(v, hd, hp.n_kv_heads, n)
    q = s.rope(q, il, None)
    k = s.rope(k, il, None)
    cur = s.attention(slot, il, q, k, v, hp.attn_scale)
    cur = g.mul(cur, g.sigmoid(gate))
    return s.linear(cur, lw["attn_output.weight"])


def l2_norm(s: Step, x: T) -> T:
    """llama.cpp's ``build_gdn_l2_norm``: an RMS norm with ``eps / n`` scaled by ``1 / sqrt(n)`` (float32)."""
    n = x.ne[0]
    return s.g.scale(s.g.rms_norm(x, f32_div(s.hp.rms_eps, n)), f32_div(1.0, f32_sqrt(n)))


def delta_net(s: Step, lw: LayerWeights, slot: int, x: T) -> T:
    """The gated delta-net of a recurrent layer on the normed ``x``."""
    g, ssm, n = s.g, s.hp.ssm, s.n
    assert ssm is not None
    hk, hv, f = ssm.d_state, ssm.head_v_dim, 4
    qkv = g.reshape(s.linear(x, lw["attn_qkv.weight"]), ssm.channels, n, 1)
    z = s.linear(x, lw["attn_gate.weight"])
    beta = g.sigmoid(g.reshape(s.linear(x, lw["ssm_beta.weight"]), 1, ssm.n_v_heads, n, 1))
    alpha = g.reshape(s.linear(x, lw["ssm_alpha.weight"]), ssm.n_v_heads, n, 1)
    decay = g.mul(g.softplus(g.add(alpha, lw["ssm_dt.bias"])), lw["ssm_a"])  # -exp(A_log) * softplus
    decay = g.reshape(decay, 1, ssm.n_v_heads, n, 1)
    mixed = g.silu(s.conv(slot, qkv, lw["ssm_conv1d.weight"]))  # [channels, n, 1]
    row = f * ssm.channels
    q = g.view_4d(mixed, (hk, ssm.n_k_heads, n, 1), (f * hk, row, row * n))
    k = g.view_4d(mixed, (hk, ssm.n_k_heads, n, 1), (f * hk, row, row * n), f * ssm.key_dim)
    v = g.view_4d(mixed, (hv, ssm.n_v_heads, n, 1), (f * hv, row, row * n), f * 2 * ssm.key_dim)
    out = s.delta_rule(slot, l2_norm(s, q), l2_norm(s, k), v, decay, beta)
    out = g.mul(s.norm(out, lw["ssm_norm.weight"]), g.silu(g.reshape(z, hv, ssm.n_v_heads, n, 1)))
    out = s.linear(g.reshape(out, hv * ssm.n_v_heads, n, 1), lw["ssm_out.weight"])
    return g.reshape(out, s.hp.width, n)


def hybrid_block(ffn: Callable[[Step, LayerWeights, T], T]) -> Callable[[Step, LayerWeights, int, T], T]:
    """A Qwen 3.5 layer with the FFN ``ffn``: norm, delta-net or gated attention, residual, post-norm, FFN."""

    def block(s: Step, lw: LayerWeights, slot: int, x: T) -> T:
        g = s.g
        cur = s.norm(x, lw["attn_norm.weight"])
        g.expand(cur)
        mixer = delta_net if s.hp.is_recurrent(lw.index) else attention
        cur = g.add(mixer(s, lw, slot, cur), x)
        return g.add(ffn(s, lw, s.norm(cur, lw["post_attention_norm.weight"])), cur)

    return block


def _dense(s: Step, lw: LayerWeights, x: T) -> T:
    return s.ffn(x, lw)


def tensors(hp: HParams, il: int) -> tuple[tuple[str, ...], tuple[str, ...]]:
    mixer = RECURRENT if hp.is_recurrent(il) else ATTENTION
    return (*mixer, "post_attention_norm.weight", *DENSE_FFN[1:]), ()


def shapes(hp: HParams) -> dict[str, tuple[int, ...]]:
    """The shared shapes, with ``attn_q`` twice as wide and the delta-net's tensors."""
    ssm = hp.ssm
    assert ssm is not None
    w, q = hp.width, hp.n_heads * hp.head_dim
    return {**standard_shapes(hp), "attn_q.weight": (w, 2 * q), "attn_qkv.weight": (w, ssm.channels),
            "attn_gate.weight": (w, ssm.d_inner), "ssm_conv1d.weight": (ssm.d_conv, ssm.channels),
            "ssm_dt.bias": (ssm.n_v_heads,), "ssm_a": (ssm.n_v_heads,), "ssm_beta.weight": (w, ssm.n_v_heads),
            "ssm_alpha.weight": (w, ssm.n_v_heads), "ssm_norm.weight": (ssm.head_v_dim,),
            "ssm_out.weight": (ssm.d_inner, w)}


def read(reader: GGUFFile, hp: HParams) -> HParams:
    """The delta-net's shape, which layers are recurrent, the rope sections; MTP layers are left out."""
    a = hp.arch
    nextn = count(reader, f"{a}.nextn_predict_layers", 0, minimum=0)
    n_layers = hp.n_layers - nextn  # the multi-token-prediction block(s) after the trunk: not run
    if n_layers < 1:
        raise UnsupportedModel(f"{a}: {nextn} prediction layers leave no trunk of {hp.n_layers} layers")
    ssm = SsmShape(d_conv=count(reader, f"{a}.ssm.conv_kernel", minimum=2),
                   d_inner=count(reader, f"{a}.ssm.inner_size"), d_state=count(reader, f"{a}.ssm.state_size"),
                   n_k_heads=count(reader, f"{a}.ssm.group_count"), n_v_heads=count(reader, f"{a}.ssm.time_step_rank"))
    if ssm.n_v_heads % ssm.n_k_heads or ssm.d_inner % ssm.n_v_heads or ssm.head_v_dim != ssm.d_state:
        raise UnsupportedModel(f"{a}: delta-net of {ssm.n_v_heads} value heads over {ssm.n_k_heads} key heads, "
                               f"inner size {ssm.d_inner}, state size {ssm.d_state} is not a shape llama.cpp runs")
    given = metadata(reader, f"{a}.attention.recurrent_layers", None)
    if isinstance(given, list):
        if len(given) < n_layers:
            raise UnsupportedModel(f"{a}.attention.recurrent_layers has {len(given)} entries for {n_layers} layers")
        recurrent = tuple(bool(r) for r in given[:n_layers])
    else:
        interval = count(reader, f"{a}.full_attention_interval", 4)
        recurrent = tuple((il + 1) % interval != 0 for il in range(n_layers))
    sections = metadata(reader, f"{a}.rope.dimension_sections")
    if not isinstance(sections, list) or not 1 <= len(sections) <= 4 or not all(
            isinstance(x, int) and 0 <= x <= 1 << 16 for x in sections) or not sum(sections):
        # (ggml's rope takes each dimension's section modulo their sum: all zeros would divide by zero)
        raise UnsupportedModel(f"{a}.rope.dimension_sections is {sections!r}, expected up to four counts, not all 0")
    rope = dataclasses.replace(hp.rope, sections=(*sections, 0, 0, 0)[:4])
    return dataclasses.replace(
        hp, n_layers=n_layers, recurrent_layers=recurrent, ssm=ssm, rope=rope, rope_swa=rope,
        swa_layers=(False,) * n_layers,
    )


FAMILY = Family(arch="qwen35", examples="Qwen3.5 0.8B to 27B",
                block=hybrid_block(_dense), layer_tensors=tensors, neox_rope=True, hparams=read, shapes=shapes)
