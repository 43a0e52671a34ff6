"""Qwen 1.5 MoE / Qwen 2 MoE (``src/models/qwen2moe.cpp``): Qwen 2's attention, experts and a gated shared expert.

Softmax router, top-k experts without renormalisation; beside them a shared expert FFN
(``expert_shared_feed_forward_length``, else ``feed_forward_length``) whose output is scaled per
token by a sigmoid gate (``ffn_gate_inp_shexp``), computed as llama.cpp does: ``silu(g) / g``.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from meshllm.engine.ggml.errors import UnsupportedModel
from meshllm.engine.ggml.families.llama import attention
from meshllm.engine.ggml.family import ATTENTION, EXPERT_FFN, SHARED_EXPERT, Family
from meshllm.engine.ggml.hparams import HParams, count

if TYPE_CHECKING:
    from meshllm.engine.ggml.blocks import Step
    from meshllm.engine.ggml.graph import T
    from meshllm.engine.ggml.weights import LayerWeights
    from meshllm.models.gguf_file import GGUFFile


def block(s: Step, lw: LayerWeights, slot: int, x: T) -> T:
    g = s.g
    cur, x = s.output_rows(lw.index, attention(s, lw, slot, x, None), x)
    ffn_in = g.add(cur, x)
    cur = s.norm(ffn_in, lw["ffn_norm.weight"])
    routed = s.moe(cur, lw)
    gate_in = g.mul_mat(lw["ffn_gate_inp_shexp.weight"], cur)  # [1, n]
    gate = g.div(g.silu(gate_in), gate_in)
    shared = g.mul(s.ffn(cur, lw, kind="_shexp"), gate)
    return g.add(g.add(routed, shared), ffn_in)


def tensors(_hp: HParams, _il: int) -> tuple[tuple[str, ...], tuple[str, ...]]:
    return (*ATTENTION, *EXPERT_FFN, "ffn_gate_inp_shexp.weight", *SHARED_EXPERT), (
        "attn_q.bias", "attn_k.bias", "attn_v.bias", "attn_output.bias")


def read(reader: GGUFFile, hp: HParams) -> HParams:
    a = hp.arch
    if not hp.n_expert:
        raise UnsupportedModel(f"{a} needs {a}.expert_count and expert_used_count > 0")
    return dataclasses.replace(
        hp, expert_ffn=count(reader, f"{a}.expert_feed_forward_length", hp.ffn // hp.n_expert_used),
        shared_ffn=count(reader, f"{a}.expert_shared_feed_forward_length", hp.ffn),
    )


FAMILY = Family(arch="qwen2moe", examples="Qwen1.5-MoE-A2.7B, Qwen2-57B-A14B", block=block, layer_tensors=tensors,
                neox_rope=True, hparams=read)
