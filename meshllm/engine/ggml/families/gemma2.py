"""Gemma 2 (``src/models/gemma2-iswa.cpp``): Gemma 3's layout without q/k norms, with soft-capping.

Attention scores are soft-capped (``attn_logit_softcapping``, 50 unless stated) and so are the final
logits (``final_logit_softcapping``, 30); layers alternate sliding-window (even) and global (odd),
with one rope for both; queries are pre-scaled by 1/sqrt(head size) (27B: by 1/sqrt(width/heads));
embeddings are scaled by sqrt(width); norms after attention and after the GELU-gated FFN.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from meshllm.engine.ggml.family import ATTENTION, DENSE_FFN, POST_NORMS, Family
from meshllm.engine.ggml.hparams import HParams, count, f32_div, f32_sqrt, number, swa_layers

if TYPE_CHECKING:
    from meshllm.engine.ggml.blocks import Step
    from meshllm.engine.ggml.graph import T
    from meshllm.engine.ggml.weights import LayerWeights
    from meshllm.models.gguf_file import GGUFFile


def block(s: Step, lw: LayerWeights, slot: int, x: T) -> T:
    g, hp, n, il = s.g, s.hp, s.n, lw.index
    cur = s.norm(x, lw["attn_norm.weight"])
    q = g.reshape(s.linear(cur, lw["attn_q.weight"]), hp.head_dim, hp.n_heads, n)
    k = g.reshape(s.linear(cur, lw["attn_k.weight"]), hp.head_dim, hp.n_kv_heads, n)
    v = g.reshape(s.linear(cur, lw["attn_v.weight"]), hp.head_dim, hp.n_kv_heads, n)
    q = g.scale(s.rope(q, il, None), hp.attn_scale)
    k = s.rope(k, il, None)
    cur = s.attention(slot, il, q, k, v, 1.0)
    cur = s.linear(cur, lw["attn_output.weight"])
    cur, x = s.output_rows(il, cur, x)
    sa_out = g.add(s.norm(cur, lw["post_attention_norm.weight"]), x)
    cur = s.ffn(s.norm(sa_out, lw["ffn_norm.weight"]), lw, "gelu")
    return g.add(s.norm(cur, lw["post_ffw_norm.weight"]), sa_out)


def tensors(_hp: HParams, _il: int) -> tuple[tuple[str, ...], tuple[str, ...]]:
    return (*ATTENTION, *DENSE_FFN, *POST_NORMS), ()


def read(reader: GGUFFile, hp: HParams) -> HParams:
    a = hp.arch
    window = count(reader, f"{a}.attention.sliding_window", 4096, minimum=0)
    scale_dim = hp.width // hp.n_heads if hp.n_layers == 46 else hp.head_dim  # 46 layers: Gemma 2 27B
    return dataclasses.replace(
        hp, attn_scale=f32_div(1.0, f32_sqrt(scale_dim)), embed_scale=f32_sqrt(hp.width),
        attn_softcap=number(reader, f"{a}.attn_logit_softcapping", float, 50.0),
        final_logit_softcap=number(reader, f"{a}.final_logit_softcapping", float, 30.0),
        sliding_window=window, swa_layers=swa_layers(reader, a, hp.n_layers, window, 2),
    )


FAMILY = Family(arch="gemma2", examples="Gemma 2 2B, 9B, 27B", block=block, layer_tensors=tensors, neox_rope=True,
                hparams=read)
