"""SmolLM3 (``src/models/smollm3.cpp``): the llama block, with no rope in every fourth layer (NoPE).

Layers 3, 7, 11, ... attend without rotary embeddings, as llama.cpp's fixed ``n_no_rope_layer_step``
of 4; everything else, optional biases included, is llama's.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from meshllm.engine.ggml.families.llama import attention, residual_block
from meshllm.engine.ggml.family import ATTENTION, BIASES, DENSE_FFN, Family
from meshllm.engine.ggml.hparams import HParams

if TYPE_CHECKING:
    from meshllm.engine.ggml.blocks import Step
    from meshllm.engine.ggml.graph import T
    from meshllm.engine.ggml.weights import LayerWeights

NO_ROPE_STEP = 4


def block(s: Step, lw: LayerWeights, slot: int, x: T) -> T:
    rope = (lw.index + 1) % NO_ROPE_STEP != 0
    return residual_block(s, lw, x, attention(s, lw, slot, x, None, rope=rope))


def tensors(_hp: HParams, _il: int) -> tuple[tuple[str, ...], tuple[str, ...]]:
    return (*ATTENTION, *DENSE_FFN), BIASES


FAMILY = Family(arch="smollm3", examples="SmolLM3-3B", block=block, layer_tensors=tensors)
