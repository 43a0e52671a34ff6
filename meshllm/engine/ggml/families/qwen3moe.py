"""Qwen 3 MoE (``src/models/qwen3moe.cpp``): Qwen 3's attention, then a mixture of SwiGLU experts.

Softmax router, top ``expert_used_count`` experts per token, their weights renormalised to sum to 1
(Qwen3-30B-A3B, Qwen3-235B-A22B, Qwen3-Coder). An expert's hidden size is
``expert_feed_forward_length``, or ``feed_forward_length / expert_used_count`` when absent (llama.cpp).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from meshllm.engine.ggml.errors import UnsupportedModel
from meshllm.engine.ggml.families.llama import residual_block
from meshllm.engine.ggml.families.qwen3 import attention
from meshllm.engine.ggml.family import ATTENTION, EXPERT_FFN, QK_NORM, Family
from meshllm.engine.ggml.hparams import HParams, count
from meshllm.models.gguf_file import GGUFFile

if TYPE_CHECKING:
    from meshllm.engine.ggml.blocks import Step
    from meshllm.engine.ggml.graph import T
    from meshllm.engine.ggml.weights import LayerWeights


def block(s: Step, lw: LayerWeights, slot: int, x: T) -> T:
    return residual_block(s, lw, x, attention(s, lw, slot, x))


def tensors(_hp: HParams, _il: int) -> tuple[tuple[str, ...], tuple[str, ...]]:
    return (*ATTENTION, *QK_NORM, *EXPERT_FFN), ()


def read(reader: GGUFFile, hp: HParams) -> HParams:
    if not hp.n_expert:
        raise UnsupportedModel(f"{hp.arch} needs {hp.arch}.expert_count and expert_used_count > 0")
    expert_ffn = count(reader, f"{hp.arch}.expert_feed_forward_length", hp.ffn // hp.n_expert_used)
    return dataclasses.replace(hp, expert_ffn=expert_ffn, expert_norm=True)


FAMILY = Family(arch="qwen3moe", examples="Qwen3-30B-A3B, Qwen3-235B-A22B, Qwen3-Coder-30B-A3B", block=block,
                layer_tensors=tensors, neox_rope=True, hparams=read)
