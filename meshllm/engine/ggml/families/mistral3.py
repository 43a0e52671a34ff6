"""Mistral 3 (``src/models/mistral3.cpp``): Mistral Small 3.x and Ministral 3 text models.

The llama block (adjacent-pair rope, optional q/k/v/o biases, dense SwiGLU or experts); with YaRN the
rope's magnitude factor is llama.cpp's ``1 / (1 + 0.1 ln(1 / freq_scale))`` in place of the file's.
Llama 4 style attention temperature tuning (``attention.temperature_scale``) is refused.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from meshllm.engine.ggml.errors import UnsupportedModel
from meshllm.engine.ggml.families.llama import block, tensors
from meshllm.engine.ggml.family import Family
from meshllm.engine.ggml.hparams import HParams, number
from meshllm.models.gguf_file import GGUFFile


def read(reader: GGUFFile, hp: HParams) -> HParams:
    if number(reader, f"{hp.arch}.attention.temperature_scale", float, 0.0):
        raise UnsupportedModel("attention temperature tuning (attention.temperature_scale) is not implemented")
    if hp.rope.freq_scale != 1.0:
        scale = np.float32(hp.rope.freq_scale)
        factor = float(np.float32(1.0) / (np.float32(1.0) + np.float32(0.1) * np.float32(math.log(1.0 / scale))))
        hp = dataclasses.replace(hp, rope=dataclasses.replace(hp.rope, attn_factor=factor))
        hp = dataclasses.replace(hp, rope_swa=hp.rope)
    return dataclasses.replace(hp, expert_norm=True) if hp.n_expert else hp


FAMILY = Family(arch="mistral3", examples="Mistral Small 3.1/3.2, Ministral 3", block=block, layer_tensors=tensors,
                hparams=read)
