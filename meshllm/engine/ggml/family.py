"""What a model family is to the runtime: its hyperparameters, its tensors per layer, its block graph.

One :class:`Family` per GGUF architecture, defined in its own module under
:mod:`meshllm.engine.ggml.families` and listed in that package's table, the way llama.cpp keeps one
``src/models/<family>.cpp`` per architecture. Adding a family is its module and one registry line;
the shared pieces (norms, rope, attention, gated FFNs, mixture of experts) live in
:mod:`meshllm.engine.ggml.blocks`, the tensor checks in :mod:`meshllm.engine.ggml.weights`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from meshllm.engine.ggml.hparams import HParams
from meshllm.models.gguf_file import GGUFFile

if TYPE_CHECKING:
    from meshllm.engine.ggml.blocks import Step
    from meshllm.engine.ggml.graph import T
    from meshllm.engine.ggml.weights import LayerWeights

Block = Callable[["Step", "LayerWeights", int, "T"], "T"]
"""``block(step, layer, slot, x) -> x``: one layer on activations [width, n]; its K/V go to cache ``slot``."""

ATTENTION = ("attn_norm.weight", "attn_q.weight", "attn_k.weight", "attn_v.weight", "attn_output.weight")
"""A pre-normed attention with separate q/k/v projections."""
DENSE_FFN = ("ffn_norm.weight", "ffn_gate.weight", "ffn_up.weight", "ffn_down.weight")
"""A pre-normed gated FFN."""
EXPERT_FFN = ("ffn_norm.weight", "ffn_gate_inp.weight", "ffn_gate_exps.weight", "ffn_up_exps.weight",
              "ffn_down_exps.weight")
"""A pre-normed mixture of gated experts: the router and the stacked expert matrices."""
SHARED_EXPERT = ("ffn_gate_shexp.weight", "ffn_up_shexp.weight", "ffn_down_shexp.weight")
"""The gated FFN of a mixture's shared expert."""
QK_NORM = ("attn_q_norm.weight", "attn_k_norm.weight")
POST_NORMS = ("post_attention_norm.weight", "post_ffw_norm.weight")
BIASES = ("attn_q.bias", "attn_k.bias", "attn_v.bias", "attn_output.bias", "ffn_gate.bias", "ffn_up.bias",
          "ffn_down.bias")


def standard_shapes(hp: HParams) -> dict[str, tuple[int, ...]]:
    """The shape (GGUF order) of every per-layer tensor name the families share, from the hyperparameters."""
    w, q, kv, f, hd = hp.width, hp.n_heads * hp.head_dim, hp.n_kv_heads * hp.head_dim, hp.ffn, hp.head_dim
    e, fe, fs = hp.n_expert, hp.expert_ffn, hp.shared_ffn
    return {
        "attn_norm.weight": (w,), "attn_q.weight": (w, q), "attn_k.weight": (w, kv), "attn_v.weight": (w, kv),
        "attn_output.weight": (q, w), "ffn_norm.weight": (w,), "ffn_gate.weight": (w, f), "ffn_up.weight": (w, f),
        "ffn_down.weight": (f, w), "attn_q.bias": (q,), "attn_k.bias": (kv,), "attn_v.bias": (kv,),
        "attn_output.bias": (w,), "ffn_gate.bias": (f,), "ffn_up.bias": (f,), "ffn_down.bias": (w,),
        "attn_q_norm.weight": (hd,), "attn_k_norm.weight": (hd,),
        "post_attention_norm.weight": (w,), "post_ffw_norm.weight": (w,),
        "ffn_gate_inp.weight": (w, e), "ffn_gate_exps.weight": (w, fe, e), "ffn_up_exps.weight": (w, fe, e),
        "ffn_down_exps.weight": (fe, w, e), "exp_probs_b.bias": (e,),
        "ffn_gate_shexp.weight": (w, fs), "ffn_up_shexp.weight": (w, fs), "ffn_down_shexp.weight": (fs, w),
        "ffn_gate_inp_shexp.weight": (w,),
    }  # fmt: skip


def _same(_reader: GGUFFile, hp: HParams) -> HParams:
    return hp


def _any(_names: set[str]) -> str | None:
    return None


@dataclass(frozen=True)
class Family:
    """One architecture: how to read it, which tensors a layer has, and how a layer is computed."""

    arch: str
    """``general.architecture`` of its GGUFs."""
    examples: str
    """Models people run that carry this architecture (for the docs and ``meshllm plan``)."""
    block: Block
    layer_tensors: Callable[[HParams, int], tuple[tuple[str, ...], tuple[str, ...]]]
    """Required and optional tensor names of layer ``il`` (after ``blk.N.``), given the hyperparameters."""
    neox_rope: bool = False
    """Rotate halves of a head (GPT-NeoX) rather than adjacent pairs: llama.cpp's ``llama_model_rope_type``."""
    hparams: Callable[[GGUFFile, HParams], HParams] = field(default=_same)
    """What only this family reads (scales, sliding windows, soft-capping), applied to the shared hparams."""
    shapes: Callable[[HParams], dict[str, tuple[int, ...]]] = field(default=standard_shapes)
    """Every per-layer tensor's expected shape."""
    check_layer: Callable[[set[str]], str | None] = field(default=_any)
    """Given a layer's tensor names, what is wrong with that combination (``None``: nothing)."""
