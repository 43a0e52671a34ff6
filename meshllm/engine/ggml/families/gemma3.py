"""Gemma 3 (the default model) as llama.cpp builds it (``src/models/gemma3.cpp``).

Differences from the llama family: RMS norms on q and k per head before rope, queries pre-scaled by
the attention scale (the attention itself then scales by 1), norms after attention and after the FFN
(before each residual add), a GELU-gated FFN, and alternating sliding-window (local) and global
layers, each kind with its own rope base (:meth:`HParams.rope_for`) and mask. Norm weights are used
as stored: llama.cpp's converter already added Gemma's ``1 +``. Embeddings are scaled by
``sqrt(width)`` on the first stage (:attr:`HParams.embed_scale`).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from meshllm.engine.ggml.family import ATTENTION, DENSE_FFN, POST_NORMS, QK_NORM, Family
from meshllm.engine.ggml.hparams import HParams, count, f32_div, f32_sqrt, number, swa_layers
from meshllm.models.gguf_file import GGUFFile

if TYPE_CHECKING:
    from meshllm.engine.ggml.blocks import Step
    from meshllm.engine.ggml.graph import T
    from meshllm.engine.ggml.weights import LayerWeights

SWA_PATTERN = 6
"""Five sliding-window layers, then one global, unless the GGUF says otherwise."""


def block(s: Step, lw: LayerWeights, slot: int, x: T) -> T:
    g, hp, n, il = s.g, s.hp, s.n, lw.index
    cur = s.norm(x, lw["attn_norm.weight"])
    q = g.reshape(s.linear(cur, lw["attn_q.weight"]), hp.head_dim, hp.n_heads, n)
    k = g.reshape(s.linear(cur, lw["attn_k.weight"]), hp.head_dim, hp.n_kv_heads, n)
    v = g.reshape(s.linear(cur, lw["attn_v.weight"]), hp.head_dim, hp.n_kv_heads, n)
    q = s.rope(s.norm(q, lw["attn_q_norm.weight"]), il, None)
    k = s.rope(s.norm(k, lw["attn_k_norm.weight"]), il, None)
    q = g.scale(q, hp.attn_scale)
    cur = s.attention(slot, il, q, k, v, 1.0)
    cur = s.linear(cur, lw["attn_output.weight"])
    cur, x = s.output_rows(il, cur, x)
    sa_out = g.add(s.norm(cur, lw["post_attention_norm.weight"]), x)
    cur = s.ffn(s.norm(sa_out, lw["ffn_norm.weight"]), lw, "gelu")
    return g.add(s.norm(cur, lw["post_ffw_norm.weight"]), sa_out)


def tensors(_hp: HParams, _il: int) -> tuple[tuple[str, ...], tuple[str, ...]]:
    return (*ATTENTION, *QK_NORM, *DENSE_FFN, *POST_NORMS), ()


def read(reader: GGUFFile, hp: HParams) -> HParams:
    a = hp.arch
    window = count(reader, f"{a}.attention.sliding_window", 0, minimum=0)
    # llama.cpp: 1/sqrt(head size), except Gemma 3 27B (62 layers) whose query_pre_attn_scalar is
    # width / heads. The GGUF does not store that scalar, so this mirrors llama.cpp exactly.
    scale_dim = hp.width // hp.n_heads if hp.n_layers == 62 else hp.head_dim
    # the local layers keep their own rope base (1e4 unless stated) and are never scaled
    rope_swa = dataclasses.replace(hp.rope, freq_base=number(reader, f"{a}.rope.freq_base_swa", float, 10000.0),
                                   freq_scale=1.0)
    return dataclasses.replace(
        hp, attn_scale=f32_div(1.0, f32_sqrt(scale_dim)), embed_scale=f32_sqrt(hp.width),
        final_logit_softcap=number(reader, f"{a}.final_logit_softcapping", float, 0.0), rope_swa=rope_swa,
        sliding_window=window, swa_layers=swa_layers(reader, a, hp.n_layers, window, SWA_PATTERN),
    )


FAMILY = Family(arch="gemma3", examples="Gemma 3 (270M to 27B)", block=block, layer_tensors=tensors, neox_rope=True,
                hparams=read)
