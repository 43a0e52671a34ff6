"""IBM Granite 3.x dense (``src/models/granite.cpp``): the llama block with Granite's four multipliers.

Embeddings are multiplied by ``embedding_scale``, each branch's output by ``residual_scale`` before
its residual add, attention scores by ``attention.scale`` (in place of 1/sqrt(head size)), and the
logits divided by ``logit_scale``. Refused here: ``rope.scaling.finetuned`` false (llama.cpp then
turns rope off) and Granite GGUFs with experts.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from meshllm.engine.ggml.errors import UnsupportedModel
from meshllm.engine.ggml.families.llama import attention
from meshllm.engine.ggml.family import ATTENTION, BIASES, DENSE_FFN, Family
from meshllm.engine.ggml.hparams import HParams, metadata, number

if TYPE_CHECKING:
    from meshllm.engine.ggml.blocks import Step
    from meshllm.engine.ggml.graph import T
    from meshllm.engine.ggml.weights import LayerWeights
    from meshllm.models.gguf_file import GGUFFile


def block(s: Step, lw: LayerWeights, slot: int, x: T) -> T:
    g, scale = s.g, s.hp.residual_scale
    cur = attention(s, lw, slot, x, s.w.rope_freqs)
    cur, x = s.output_rows(lw.index, cur, x)
    if scale:
        cur = g.scale(cur, scale)
    ffn_in = g.add(cur, x)
    cur = s.ffn(s.norm(ffn_in, lw["ffn_norm.weight"]), lw)
    if scale:
        cur = g.scale(cur, scale)
    return g.add(cur, ffn_in)


def tensors(_hp: HParams, _il: int) -> tuple[tuple[str, ...], tuple[str, ...]]:
    return (*ATTENTION, *DENSE_FFN), BIASES


def read(reader: GGUFFile, hp: HParams) -> HParams:
    a = hp.arch
    if hp.n_expert:
        raise UnsupportedModel("Granite with experts (Granite MoE) is not implemented")
    if not metadata(reader, f"{a}.rope.scaling.finetuned", True):
        raise UnsupportedModel("Granite without rope (rope.scaling.finetuned false) is not implemented")
    attn_scale = number(reader, f"{a}.attention.scale", float, 0.0)
    logit_scale = number(reader, f"{a}.logit_scale", float)
    if logit_scale <= 0:
        raise UnsupportedModel(f"{a}.logit_scale is {logit_scale}, expected a positive divisor")
    return dataclasses.replace(
        hp, logit_scale=logit_scale,
        residual_scale=number(reader, f"{a}.residual_scale", float, 0.0),
        embed_scale=number(reader, f"{a}.embedding_scale", float, 0.0) or 1.0,
        attn_scale=attn_scale or hp.attn_scale,
    )


FAMILY = Family(arch="granite", examples="Granite 3.0/3.1/3.2/3.3 2B and 8B", block=block, layer_tensors=tensors,
                hparams=read)
