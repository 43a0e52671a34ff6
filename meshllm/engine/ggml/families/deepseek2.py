"""DeepSeek V2 / V2.5 / V3 / R1, Kimi K2 and the files that carry their architecture (``deepseek2``;
llama.cpp's ``src/models/deepseek2.cpp``), in both of llama.cpp's forms.

Attention is multi-head latent attention: the query comes from ``attn_q`` (Lite) or a low-rank pair
``attn_q_a`` -> RMS norm -> ``attn_q_b``; keys and values from one compressed latent per token
(``attn_kv_a_mqa``: ``kv_lora`` latent values plus a shared rotary key part), RMS-normed and expanded
per head by ``attn_kv_b`` into a key part without rope and the value. Each key head is that part
followed by the shared rotary part (tiled over the heads), each query head its own part with the
trailing ``n_rot`` dimensions rotated (adjacent pairs). Key heads (``key_length``) are wider than
value heads (``value_length``), so the KV cache holds K and V rows of different widths. Files in
the absorbed layout (``key_length_mla``; ``attn_k_b`` and ``attn_v_b`` instead of ``attn_kv_b``,
what current conversions write) run llama.cpp's absorbed form instead: ``attn_k_b`` folds into each
query head, keys are the latent plus the rotary part (one KV head), the cache keeps only K, values
are each key's leading ``kv_lora`` dimensions, and ``attn_v_b`` expands the attended latent per
head. The FFN is
dense in the ``leading_dense_block_count`` first layers, then a mixture of experts (softmax or
sigmoid router, optional selection bias ``exp_probs_b``, weights optionally renormalised and scaled)
plus ``expert_shared_count`` shared experts, summed.

With ``expert_group_count`` > 1 (DeepSeek V3) a token chooses only among the experts of its
``expert_group_used_count`` best groups. DeepSeek's YaRN (``yarn_log_multiplier``) scales the rope
magnitude and, squared, the attention scores as llama.cpp does. Refused, each naming itself: linear
rope scaling and attention temperature scaling.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Literal

import numpy as np

from meshllm.engine.ggml.errors import UnsupportedModel
from meshllm.engine.ggml.family import Family, standard_shapes
from meshllm.engine.ggml.hparams import HParams, count, metadata, number

if TYPE_CHECKING:
    from meshllm.engine.ggml.blocks import Step
    from meshllm.engine.ggml.graph import T
    from meshllm.engine.ggml.weights import LayerWeights
    from meshllm.models.gguf_file import GGUFFile

_GATING: dict[int, Literal["softmax", "sigmoid"]] = {1: "softmax", 2: "sigmoid"}


def attention(s: Step, lw: LayerWeights, slot: int, x: T) -> T:
    """Norm, latent attention (llama.cpp's absorbed or non-absorbed path) and the output projection."""
    g, hp, n, il = s.g, s.hp, s.n, lw.index
    hd, hd_v, rot, rank = hp.q_head_dim, hp.head_dim_v, hp.rope.n_rot, hp.kv_lora
    nope = hd - rot
    cur = s.norm(x, lw["attn_norm.weight"])
    if hp.q_lora:
        q = s.norm(g.mul_mat(lw["attn_q_a.weight"], cur), lw["attn_q_a_norm.weight"])
        q = g.mul_mat(lw["attn_q_b.weight"], q)
    else:
        q = g.mul_mat(lw["attn_q.weight"], cur)
    q = g.reshape(q, hd, hp.n_heads, n)
    latent = g.mul_mat(lw["attn_kv_a_mqa.weight"], cur)  # [kv_lora + rot, n]
    row = latent.nb[1]
    compressed = g.view(latent, (rank, n), (row,))
    k_pe = g.view(latent, (rot, 1, n), (row, row), latent.nb[0] * rank)
    k_pe = s.rope(k_pe, il, None)
    compressed = s.norm(compressed, lw["attn_kv_a_norm.weight"])
    if hp.v_in_k:
        q_nope = g.view(q, (nope, hp.n_heads, n), (q.nb[1], q.nb[2]))
        q_pe = s.rope(g.view(q, (rot, hp.n_heads, n), (q.nb[1], q.nb[2]), q.nb[0] * nope), il, None)
        absorbed = g.permute(g.mul_mat(lw["attn_k_b.weight"], g.permute(q_nope, 0, 2, 1, 3)), 0, 2, 1, 3)
        q = g.concat(absorbed, q_pe, 0)  # [kv_lora + rot, heads, n]
        latent_v = g.reshape(compressed, rank, 1, n)
        k = g.concat(latent_v, k_pe, 0)  # [kv_lora + rot, 1, n]
        cur = s.attention(slot, il, q, k, latent_v, hp.attn_scale, v_mla=lw["attn_v_b.weight"])
        return g.mul_mat(lw["attn_output.weight"], cur)
    kv = g.mul_mat(lw["attn_kv_b.weight"], compressed)  # [heads * (nope + hd_v), n]
    elt, head = kv.nb[0], kv.nb[0] * (nope + hd_v)
    k_nope = g.view(kv, (nope, hp.n_heads, n), (head, head * hp.n_heads))
    v = g.cont(g.view(kv, (hd_v, hp.n_heads, n), (head, head * hp.n_heads), elt * nope))
    q = s.rope(q, il, None, offset=nope)
    k = g.concat(k_nope, g.repeat_4d(k_pe, rot, hp.n_heads, n, 1), 0)
    cur = s.attention(slot, il, q, k, v, hp.attn_scale)
    return g.mul_mat(lw["attn_output.weight"], cur)


def block(s: Step, lw: LayerWeights, slot: int, x: T) -> T:
    g, il = s.g, lw.index
    cur, x = s.output_rows(il, attention(s, lw, slot, x), x)
    ffn_in = g.add(cur, x)
    cur = s.norm(ffn_in, lw["ffn_norm.weight"])
    # the experts' graph is built before the shared expert's, as llama.cpp builds them
    cur = g.add(s.moe(cur, lw), s.ffn(cur, lw, kind="_shexp")) if s.hp.has_experts(il) else s.ffn(cur, lw)
    return g.add(cur, ffn_in)


def tensors(hp: HParams, il: int) -> tuple[tuple[str, ...], tuple[str, ...]]:
    q = ("attn_q_a.weight", "attn_q_a_norm.weight", "attn_q_b.weight") if hp.q_lora else ("attn_q.weight",)
    kv = ("attn_k_b.weight", "attn_v_b.weight") if hp.v_in_k else ("attn_kv_b.weight",)
    attn = ("attn_norm.weight", *q, "attn_kv_a_mqa.weight", "attn_kv_a_norm.weight", *kv, "attn_output.weight",
            "ffn_norm.weight")
    if not hp.has_experts(il):
        return (*attn, "ffn_gate.weight", "ffn_up.weight", "ffn_down.weight"), ()
    return (*attn, "ffn_gate_inp.weight", "ffn_gate_exps.weight", "ffn_up_exps.weight", "ffn_down_exps.weight",
            "ffn_gate_shexp.weight", "ffn_up_shexp.weight", "ffn_down_shexp.weight"), ("exp_probs_b.bias",)


def shapes(hp: HParams) -> dict[str, tuple[int, ...]]:
    w, h, hd, rot, rank, v = hp.width, hp.n_heads, hp.q_head_dim, hp.rope.n_rot, hp.kv_lora, hp.out_head_dim
    return {
        **standard_shapes(hp),
        "attn_q.weight": (w, h * hd), "attn_q_a.weight": (w, hp.q_lora), "attn_q_a_norm.weight": (hp.q_lora,),
        "attn_q_b.weight": (hp.q_lora, h * hd), "attn_kv_a_mqa.weight": (w, rank + rot),
        "attn_kv_a_norm.weight": (rank,), "attn_kv_b.weight": (rank, h * (hd - rot + v)),
        "attn_k_b.weight": (hd - rot, rank, h), "attn_v_b.weight": (rank, v, h), "attn_output.weight": (h * v, w),
    }  # fmt: skip


def read(reader: GGUFFile, hp: HParams) -> HParams:
    a = hp.arch
    k_mla = count(reader, f"{a}.attention.key_length_mla", 0, minimum=0)
    v_mla = count(reader, f"{a}.attention.value_length_mla", 0, minimum=0)
    if bool(k_mla) != bool(v_mla):
        raise UnsupportedModel("key_length_mla and value_length_mla must be given together")
    kv_lora = count(reader, f"{a}.attention.kv_lora_rank")
    if k_mla:  # absorbed: one KV head of the latent plus the rotary part; V read from K
        if hp.n_kv_heads != 1 or hp.head_dim != kv_lora + hp.rope.n_rot or hp.head_dim_v != kv_lora:
            raise UnsupportedModel(f"{a} in the absorbed layout needs one KV head of kv_lora_rank + rope "
                                   f"dimensions and values of kv_lora_rank")
        hp = dataclasses.replace(hp, v_in_k=True, mla_head_dims=(k_mla, v_mla))
    elif hp.n_kv_heads != hp.n_heads:
        raise UnsupportedModel(f"{a} needs as many KV heads as heads")
    if hp.rope.n_rot >= hp.q_head_dim:
        raise UnsupportedModel(f"{a}'s rotary part must be narrower than its key head")
    rope = hp.rope
    if rope.freq_scale != 1.0 and not rope.ext_factor:
        raise UnsupportedModel("DeepSeek with linear rope scaling is not implemented (its YaRN is)")
    if number(reader, f"{a}.attention.temperature_scale", float, 0.0):
        raise UnsupportedModel("attention temperature scaling is not implemented")
    groups = count(reader, f"{a}.expert_group_count", 0, minimum=0)
    used = count(reader, f"{a}.expert_group_used_count", 0, minimum=0)
    if groups > 1 and (hp.n_expert % groups or hp.n_expert // groups < 2 or not 0 < used < groups):
        raise UnsupportedModel(f"{hp.n_expert} experts in {groups} groups, {used} used: not a valid grouping")
    if not hp.n_expert:
        raise UnsupportedModel(f"{a} needs {a}.expert_count and expert_used_count > 0")
    gating = count(reader, f"{a}.expert_gating_func", 0, minimum=0) or 1
    if gating not in _GATING:
        raise UnsupportedModel(f"expert gating function {gating} is not implemented (softmax 1, sigmoid 2 are)")
    expert_ffn = count(reader, f"{a}.expert_feed_forward_length")
    return dataclasses.replace(
        hp, mixed_kv_widths=True, q_lora=count(reader, f"{a}.attention.q_lora_rank", 0, minimum=0),
        kv_lora=kv_lora, expert_gating=_GATING[gating],
        expert_norm=bool(metadata(reader, f"{a}.expert_weights_norm", False)), expert_ffn=expert_ffn,
        shared_ffn=expert_ffn * count(reader, f"{a}.expert_shared_count"),
        n_dense_lead=count(reader, f"{a}.leading_dense_block_count", 0, minimum=0),
        expert_groups=(groups, used) if groups > 1 else (0, 0), attn_scale=_kq_scale(hp),
    )


def _kq_scale(hp: HParams) -> float:
    """llama.cpp's DeepSeek score scale in float32: YaRN's magnitude (undone from the rope's, then with
    ``mscale_all_dim``) squared, over the square root of the query head width."""
    one, tenth = np.float32(1.0), np.float32(0.1)
    log_inv = np.log(one / np.float32(hp.rope.freq_scale))
    original = np.float32(hp.rope.attn_factor) * (one + tenth * log_inv)
    mscale = original * (one + tenth * np.float32(hp.rope.yarn_log_mul) * log_inv)
    return float(one * mscale * mscale / np.sqrt(np.float32(hp.q_head_dim)))


FAMILY = Family(arch="deepseek2", examples="DeepSeek V2, V2-Lite, V2.5, V3, R1, Kimi K2", block=block,
                layer_tensors=tensors, hparams=read, shapes=shapes)
