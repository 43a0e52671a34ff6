"""Qwen 2 / 2.5 (``src/models/qwen2.cpp``): the llama block with q/k/v biases and GPT-NeoX rope (halves)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from meshllm.engine.ggml.families.llama import attention, residual_block
from meshllm.engine.ggml.family import ATTENTION, BIASES, DENSE_FFN, Family
from meshllm.engine.ggml.hparams import HParams

if TYPE_CHECKING:
    from meshllm.engine.ggml.blocks import Step
    from meshllm.engine.ggml.graph import T
    from meshllm.engine.ggml.weights import LayerWeights


def block(s: Step, lw: LayerWeights, slot: int, x: T) -> T:
    return residual_block(s, lw, x, attention(s, lw, slot, x, None))  # llama 3's rope factors are llama's alone


def tensors(_hp: HParams, _il: int) -> tuple[tuple[str, ...], tuple[str, ...]]:
    return (*ATTENTION, *DENSE_FFN), BIASES


FAMILY = Family(arch="qwen2", examples="Qwen2, Qwen2.5", block=block, layer_tensors=tensors, neox_rope=True)
