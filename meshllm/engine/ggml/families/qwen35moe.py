"""Qwen 3.5 MoE (``src/models/qwen35moe.cpp``): Qwen 3.5's hybrid layers with a mixture of experts as the FFN.

The delta-net and gated attention layers are :mod:`.qwen35`'s. The FFN of every layer is a softmax
router over ``expert_count`` SwiGLU experts, the top ``expert_used_count`` renormalised (and scaled by
``expert_weights_scale``), plus a shared expert whose output is scaled per token by ``sigmoid`` of its
own gate (``ffn_gate_inp_shexp``). Qwen3.5-35B-A3B, -122B-A10B, -397B-A17B.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from meshllm.engine.ggml.errors import UnsupportedModel
from meshllm.engine.ggml.families import qwen35
from meshllm.engine.ggml.family import EXPERT_FFN, SHARED_EXPERT, Family
from meshllm.engine.ggml.hparams import HParams, count
from meshllm.models.gguf_file import GGUFFile

if TYPE_CHECKING:
    from meshllm.engine.ggml.blocks import Step
    from meshllm.engine.ggml.graph import T
    from meshllm.engine.ggml.weights import LayerWeights


def experts(s: Step, lw: LayerWeights, x: T) -> T:
    """Routed experts plus the sigmoid-gated shared expert."""
    g = s.g
    routed = s.moe(x, lw)
    shared = s.ffn(x, lw, kind="_shexp")
    gate = g.sigmoid(g.mul_mat(lw["ffn_gate_inp_shexp.weight"], x))  # [1, n]
    return g.add(routed, g.mul(shared, gate))


def tensors(hp: HParams, il: int) -> tuple[tuple[str, ...], tuple[str, ...]]:
    mixer = qwen35.RECURRENT if hp.is_recurrent(il) else qwen35.ATTENTION
    return (*mixer, "post_attention_norm.weight", *EXPERT_FFN[1:], "ffn_gate_inp_shexp.weight", *SHARED_EXPERT), ()


def read(reader: GGUFFile, hp: HParams) -> HParams:
    a = hp.arch
    if not hp.n_expert:
        raise UnsupportedModel(f"{a} needs {a}.expert_count and expert_used_count > 0")
    hp = dataclasses.replace(
        hp, expert_ffn=count(reader, f"{a}.expert_feed_forward_length", hp.ffn // hp.n_expert_used),
        shared_ffn=count(reader, f"{a}.expert_shared_feed_forward_length", hp.ffn), expert_norm=True,
    )
    return qwen35.read(reader, hp)


FAMILY = Family(arch="qwen35moe", examples="Qwen3.5-35B-A3B, Qwen3.5-122B-A10B, Qwen3.5-397B-A17B",
                block=qwen35.hybrid_block(experts), layer_tensors=tensors, neox_rope=True, hparams=read,
                shapes=qwen35.shapes)
