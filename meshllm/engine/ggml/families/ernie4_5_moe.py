"""ERNIE 4.5 MoE (``ernie4_5-moe``; llama.cpp's ``src/models/ernie4-5-moe.cpp``): ERNIE-4.5-21B-A3B, 300B-A47B.

ERNIE's attention (:mod:`.ernie4_5`), then per layer either a dense FFN or, from
``leading_dense_block_count`` on and every ``interleave_moe_layer_step``-th layer, a mixture of
experts: softmax router, a selection bias (``exp_probs_b``), renormalised weights, plus the shared
experts every token runs, when ``expert_shared_feed_forward_length`` gives their width (llama.cpp
ignores shared-expert tensors without it).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from meshllm.engine.ggml.errors import UnsupportedModel
from meshllm.engine.ggml.families.llama import attention
from meshllm.engine.ggml.family import ATTENTION, DENSE_FFN, EXPERT_FFN, SHARED_EXPERT, Family
from meshllm.engine.ggml.hparams import HParams, count

if TYPE_CHECKING:
    from meshllm.engine.ggml.blocks import Step
    from meshllm.engine.ggml.graph import T
    from meshllm.engine.ggml.weights import LayerWeights
    from meshllm.models.gguf_file import GGUFFile


def block(s: Step, lw: LayerWeights, slot: int, x: T) -> T:
    g, il = s.g, lw.index
    cur, x = s.output_rows(il, attention(s, lw, slot, x, None), x)
    ffn_in = g.add(cur, x)
    cur = s.norm(ffn_in, lw["ffn_norm.weight"])
    if not s.hp.has_experts(il):
        cur = s.ffn(cur, lw)
    else:
        routed = s.moe(cur, lw)
        cur = g.add(routed, s.ffn(cur, lw, kind="_shexp")) if s.hp.shared_ffn else routed
    return g.add(cur, ffn_in)


def tensors(hp: HParams, il: int) -> tuple[tuple[str, ...], tuple[str, ...]]:
    biases = ("attn_q.bias", "attn_k.bias", "attn_v.bias")
    if not hp.has_experts(il):
        return (*ATTENTION, *DENSE_FFN), biases
    return (*ATTENTION, *EXPERT_FFN, "exp_probs_b.bias", *(SHARED_EXPERT if hp.shared_ffn else ())), biases


def read(reader: GGUFFile, hp: HParams) -> HParams:
    a = hp.arch
    if not hp.n_expert:
        raise UnsupportedModel(f"{a} needs {a}.expert_count and expert_used_count > 0")
    expert_ffn = count(reader, f"{a}.expert_feed_forward_length", hp.ffn)
    return dataclasses.replace(
        hp, expert_ffn=expert_ffn, expert_norm=True,
        shared_ffn=count(reader, f"{a}.expert_shared_feed_forward_length", 0, minimum=0),
        n_dense_lead=count(reader, f"{a}.leading_dense_block_count", 0, minimum=0),
        moe_step=count(reader, f"{a}.interleave_moe_layer_step"),
    )


FAMILY = Family(arch="ernie4_5-moe", examples="ERNIE-4.5-21B-A3B, ERNIE-4.5-300B-A47B", block=block,
                layer_tensors=tensors, hparams=read)
