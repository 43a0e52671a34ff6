"""gpt-oss (``general.architecture`` ``gpt-oss``; llama.cpp's ``src/models/openai-moe-iswa.cpp``).

Attention with biases on every projection and a learned sink logit per head joining each softmax
(``attn_sinks``), rope over halves, layers alternating sliding-window (even) and global (odd) with one
rope; then ``post_attention_norm`` and a mixture of experts: router with a bias, selection on the raw
logits and a softmax over the chosen ones (``softmax_weight``), per-expert biases on every projection,
and the clamped SwiGLU (alpha 1.702, limit 7). Published files store the experts in MXFP4.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from meshllm.engine.ggml.errors import UnsupportedModel
from meshllm.engine.ggml.family import Family, standard_shapes
from meshllm.engine.ggml.hparams import HParams, count, swa_layers

if TYPE_CHECKING:
    from meshllm.engine.ggml.blocks import Step
    from meshllm.engine.ggml.graph import T
    from meshllm.engine.ggml.weights import LayerWeights
    from meshllm.models.gguf_file import GGUFFile


def block(s: Step, lw: LayerWeights, slot: int, x: T) -> T:
    g, hp, n, il = s.g, s.hp, s.n, lw.index
    cur = s.norm(x, lw["attn_norm.weight"])
    q = g.reshape(s.linear(cur, lw["attn_q.weight"], lw.get("attn_q.bias")), hp.head_dim, hp.n_heads, n)
    k = g.reshape(s.linear(cur, lw["attn_k.weight"], lw.get("attn_k.bias")), hp.head_dim, hp.n_kv_heads, n)
    v = g.reshape(s.linear(cur, lw["attn_v.weight"], lw.get("attn_v.bias")), hp.head_dim, hp.n_kv_heads, n)
    q = s.rope(q, il, None)
    k = s.rope(k, il, None)
    cur = s.attention(slot, il, q, k, v, hp.attn_scale, lw["attn_sinks.weight"])
    cur = s.linear(cur, lw["attn_output.weight"], lw.get("attn_output.bias"))
    cur, x = s.output_rows(il, cur, x)
    ffn_in = g.add(cur, x)
    return g.add(s.moe(s.norm(ffn_in, lw["post_attention_norm.weight"]), lw), ffn_in)


def tensors(_hp: HParams, _il: int) -> tuple[tuple[str, ...], tuple[str, ...]]:
    return ("attn_norm.weight", "attn_q.weight", "attn_k.weight", "attn_v.weight", "attn_output.weight",
            "attn_sinks.weight", "post_attention_norm.weight", "ffn_gate_inp.weight", "ffn_gate_exps.weight",
            "ffn_up_exps.weight", "ffn_down_exps.weight"), (
        "attn_q.bias", "attn_k.bias", "attn_v.bias", "attn_output.bias", "ffn_gate_inp.bias", "ffn_gate_exps.bias",
        "ffn_up_exps.bias", "ffn_down_exps.bias")


def shapes(hp: HParams) -> dict[str, tuple[int, ...]]:
    e, fe = hp.n_expert, hp.expert_ffn
    return {**standard_shapes(hp), "attn_sinks.weight": (hp.n_heads,), "ffn_gate_inp.bias": (e,),
            "ffn_gate_exps.bias": (fe, e), "ffn_up_exps.bias": (fe, e), "ffn_down_exps.bias": (hp.width, e)}


def read(reader: GGUFFile, hp: HParams) -> HParams:
    if not hp.n_expert:
        raise UnsupportedModel(f"{hp.arch} needs {hp.arch}.expert_count and expert_used_count > 0")
    window = count(reader, f"{hp.arch}.attention.sliding_window", 0, minimum=0)
    return dataclasses.replace(hp, expert_gating="softmax_weight", expert_act="swiglu_oai", sliding_window=window,
                               swa_layers=swa_layers(reader, hp.arch, hp.n_layers, window, 2))


FAMILY = Family(arch="gpt-oss", examples="gpt-oss-20b, gpt-oss-120b", block=block, layer_tensors=tensors,
                neox_rope=True, hparams=read, shapes=shapes)
