"""LLaMA and the files that carry its architecture (Llama 2/3, Mistral 7B, SmolLM, Mixtral) as llama.cpp builds them.

Pre-norm attention and a SwiGLU FFN, each added to the residual stream (``src/models/llama.cpp``).
Rope rotates adjacent pairs (the converter permuted q/k for that); llama 3's ``rope_freqs`` factors
apply. Any optional bias a llama GGUF carries is added after its projection. A GGUF with
``llama.expert_count`` (Mixtral) has a mixture of experts instead of the FFN: softmax router, top-k,
weights renormalised.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from meshllm.engine.ggml.family import ATTENTION, BIASES, DENSE_FFN, EXPERT_FFN, Family
from meshllm.engine.ggml.hparams import HParams
from meshllm.models.gguf_file import GGUFFile

if TYPE_CHECKING:
    from meshllm.engine.ggml.blocks import Step
    from meshllm.engine.ggml.graph import T
    from meshllm.engine.ggml.weights import LayerWeights


def attention(s: Step, lw: LayerWeights, slot: int, x: T, rope_factors: T | None, *, rope: bool = True) -> T:
    """Norm, q/k/v (+ biases), rope (unless not ``rope``), attention and output projection: the llama-style
    attention half."""
    g, hp, n, il = s.g, s.hp, s.n, lw.index
    cur = s.norm(x, lw["attn_norm.weight"])
    q = s.linear(cur, lw["attn_q.weight"], lw.get("attn_q.bias"))
    k = s.linear(cur, lw["attn_k.weight"], lw.get("attn_k.bias"))
    v = s.linear(cur, lw["attn_v.weight"], lw.get("attn_v.bias"))
    q = g.reshape(q, hp.head_dim, hp.n_heads, n)
    k = g.reshape(k, hp.head_dim, hp.n_kv_heads, n)
    v = g.reshape(v, hp.head_dim, hp.n_kv_heads, n)
    if rope:
        q = s.rope(q, il, rope_factors)
        k = s.rope(k, il, rope_factors)
    cur = s.attention(slot, il, q, k, v, hp.attn_scale)
    return s.linear(cur, lw["attn_output.weight"], lw.get("attn_output.bias"))


def residual_block(s: Step, lw: LayerWeights, x: T, attn_out: T) -> T:
    """Residual add, FFN norm, the FFN (or experts when the layer has a router), residual add."""
    cur, residual = s.output_rows(lw.index, attn_out, x)
    ffn_in = s.g.add(cur, residual)
    cur = s.norm(ffn_in, lw["ffn_norm.weight"])
    cur = s.moe(cur, lw) if lw.get("ffn_gate_inp.weight") is not None else s.ffn(cur, lw)
    return s.g.add(cur, ffn_in)


def block(s: Step, lw: LayerWeights, slot: int, x: T) -> T:
    return residual_block(s, lw, x, attention(s, lw, slot, x, s.w.rope_freqs))


def tensors(hp: HParams, _il: int) -> tuple[tuple[str, ...], tuple[str, ...]]:
    if hp.n_expert:
        return (*ATTENTION, *EXPERT_FFN), ("attn_output.bias",)
    return (*ATTENTION, *DENSE_FFN), BIASES


def read(_reader: GGUFFile, hp: HParams) -> HParams:
    return dataclasses.replace(hp, expert_norm=True) if hp.n_expert else hp


FAMILY = Family(
    arch="llama", examples="Llama 2/3, Mistral 7B, SmolLM2, Mixtral 8x7B", block=block, layer_tensors=tensors,
    hparams=read,
)
