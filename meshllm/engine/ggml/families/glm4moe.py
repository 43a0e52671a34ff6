"""GLM-4.5 / 4.6 / 4.7 (``glm4moe``; llama.cpp's ``src/models/glm4-moe.cpp``).

Attention with q/k/v biases and, on some sizes, per-head q/k norms; rope over the first
``rope.dimension_count`` dimensions of each head (partial rotary), halves. After the residual add a
``post_attention_norm`` feeds the FFN: dense in the ``leading_dense_block_count`` first layers, else
a mixture of experts (sigmoid router by default, a selection bias ``exp_probs_b``, weights
optionally renormalised and scaled) plus a shared expert every token runs, summed. Down projections
of dense and shared FFNs accumulate in f32, as llama.cpp asks for GLM. The multi-token-prediction
layers at the end of the file (``nextn_predict_layers``) are not part of the model's forward pass,
as in llama.cpp; M-RoPE (the vision variants) is refused.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Literal

from meshllm.engine.ggml.errors import UnsupportedModel
from meshllm.engine.ggml.families.qwen3 import attention
from meshllm.engine.ggml.family import ATTENTION, SHARED_EXPERT, Family
from meshllm.engine.ggml.hparams import HParams, count, metadata

if TYPE_CHECKING:
    from meshllm.engine.ggml.blocks import Step
    from meshllm.engine.ggml.graph import T
    from meshllm.engine.ggml.weights import LayerWeights
    from meshllm.models.gguf_file import GGUFFile

_GATING: dict[int, Literal["softmax", "sigmoid"]] = {1: "softmax", 2: "sigmoid"}
"""``expert_gating_func`` values (gguf's ExpertGatingFuncType) this runtime implements."""


def block(s: Step, lw: LayerWeights, slot: int, x: T) -> T:
    g, il = s.g, lw.index
    cur, x = s.output_rows(il, attention(s, lw, slot, x), x)
    ffn_in = g.add(cur, x)
    cur = s.norm(ffn_in, lw["post_attention_norm.weight"])
    if not s.hp.has_experts(il):
        cur = s.ffn(cur, lw, f32_down=True)
    else:
        routed = s.moe(cur, lw)
        cur = g.add(routed, s.ffn(cur, lw, kind="_shexp", f32_down=True)) if s.hp.shared_ffn else routed
    return g.add(cur, ffn_in)


def tensors(hp: HParams, il: int) -> tuple[tuple[str, ...], tuple[str, ...]]:
    optional = ("attn_q.bias", "attn_k.bias", "attn_v.bias", "attn_q_norm.weight", "attn_k_norm.weight")
    if not hp.has_experts(il):
        return (*ATTENTION, "post_attention_norm.weight", "ffn_gate.weight", "ffn_up.weight", "ffn_down.weight"), \
            optional
    shared = SHARED_EXPERT if hp.shared_ffn else ()
    return (*ATTENTION, "post_attention_norm.weight", "ffn_gate_inp.weight", "exp_probs_b.bias",
            "ffn_gate_exps.weight", "ffn_up_exps.weight", "ffn_down_exps.weight", *shared), optional


def read(reader: GGUFFile, hp: HParams) -> HParams:
    a = hp.arch
    if not hp.n_expert:
        raise UnsupportedModel(f"{a} needs {a}.expert_count and expert_used_count > 0")
    sections = metadata(reader, f"{a}.rope.dimension_sections", [])
    if isinstance(sections, list) and any(sections):
        raise UnsupportedModel("GLM with M-RoPE sections (the vision variants) is not implemented")
    gating = count(reader, f"{a}.expert_gating_func", 2, minimum=0) or 2
    if gating not in _GATING:
        raise UnsupportedModel(f"expert gating function {gating} is not implemented (softmax 1, sigmoid 2 are)")
    nextn = count(reader, f"{a}.nextn_predict_layers", 0, minimum=0)
    if nextn >= hp.n_layers:
        raise UnsupportedModel(f"{nextn} prediction layers of {hp.n_layers} leave no model")
    n_layers = hp.n_layers - nextn
    expert_ffn = count(reader, f"{a}.expert_feed_forward_length")
    return dataclasses.replace(
        hp, n_layers=n_layers, swa_layers=hp.swa_layers[:n_layers], expert_gating=_GATING[gating],
        expert_norm=bool(metadata(reader, f"{a}.expert_weights_norm", False)),
        expert_ffn=expert_ffn,
        shared_ffn=expert_ffn * count(reader, f"{a}.expert_shared_count", 0, minimum=0),
        n_dense_lead=count(reader, f"{a}.leading_dense_block_count", 0, minimum=0),
    )


FAMILY = Family(arch="glm4moe", examples="GLM-4.5, GLM-4.5-Air, GLM-4.6, GLM-4.7", block=block,
                layer_tensors=tensors, neox_rope=True, hparams=read)
