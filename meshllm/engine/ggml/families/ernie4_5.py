"""ERNIE 4.5 dense (``general.architecture`` ``ernie4_5``; llama.cpp's ``src/models/ernie4-5.cpp``).

The llama block as llama.cpp builds it for ERNIE: optional q/k/v biases, rope over adjacent pairs, no
rope frequency factors, no output bias. The MoE variants are :mod:`.ernie4_5_moe`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from meshllm.engine.ggml.families.llama import attention, residual_block
from meshllm.engine.ggml.family import ATTENTION, DENSE_FFN, Family
from meshllm.engine.ggml.hparams import HParams

if TYPE_CHECKING:
    from meshllm.engine.ggml.blocks import Step
    from meshllm.engine.ggml.graph import T
    from meshllm.engine.ggml.weights import LayerWeights


def block(s: Step, lw: LayerWeights, slot: int, x: T) -> T:
    return residual_block(s, lw, x, attention(s, lw, slot, x, None))


def tensors(_hp: HParams, _il: int) -> tuple[tuple[str, ...], tuple[str, ...]]:
    return (*ATTENTION, *DENSE_FFN), ("attn_q.bias", "attn_k.bias", "attn_v.bias")


FAMILY = Family(arch="ernie4_5", examples="ERNIE-4.5-0.3B", block=block, layer_tensors=tensors)
