"""How much memory a stage will take, from the GGUF header alone, for the split planner.

A loaded stage holds (``StageModel.memory()`` reports the same parts):

- its tensors as stored in the file: quantized bytes, used in place from the file map or copied
  once into a repacked or device buffer (a tied embedding/head table counted once);
- per session, a KV cache of ``layers x 2 x kv_heads x head_dim`` f16 values per token, for the
  context rounded up to 256 tokens (:func:`~meshllm.engine.ggml.kv_cache.padded`);
- compute buffers, largest for a full prompt chunk (:data:`~meshllm.engine.ggml.stage.CHUNK` tokens
  attending to the whole context): :func:`compute_bytes` bounds them from the shapes.

Reading the header costs milliseconds, so the planner can price every candidate range.
``tests/engine/ggml/test_ggml_memory.py`` checks the estimate against what a loaded stage holds and
against its process's RSS.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from meshllm.engine.ggml.hparams import HParams, read_hparams
from meshllm.engine.ggml.kv_cache import kv_bytes_per_token, padded
from meshllm.engine.ggml.stage import CHUNK
from meshllm.engine.ggml.weights import plan_stage
from meshllm.models.gguf_file import GGUFFile

_F32 = 4


def compute_bytes(hp: HParams, context: int, chunk: int = CHUNK, flash_attn: bool = False) -> int:
    """An upper bound on one graph's compute buffers: a ``chunk``-token prompt over ``context`` cached tokens.

    The graph holds its attention masks (one per kind of layer, [context, chunk], f16 for flash
    attention) throughout; the attention phase adds q/k/v, the scores [context, chunk, heads] (not
    with flash attention) and the attention output; the FFN phase gate, up and their product; both
    keep the residual stream. Measured on the default model at a full 4096-token context: 57 MB
    (softmax) and 26 MB (flash attention) against 68 MB and 27 MB here; a margin of 10 % covers the
    allocator's alignment and the ops' small temporaries. (The last stage also holds one row of
    logits: :attr:`MemoryProfile.logits_bytes`.)
    """
    n_kv = padded(context)
    chunk = min(chunk, context)  # a prompt chunk never exceeds the context
    masks = (2 if hp.sliding_window else 1) * n_kv * chunk * (2 if flash_attn else _F32)
    qkv = (hp.n_heads + 2 * hp.n_kv_heads) * hp.head_dim
    scores = 0 if flash_attn else n_kv * hp.n_heads
    attention = chunk * (qkv + scores + 2 * hp.n_heads * hp.head_dim) * _F32
    ffn = chunk * 3 * hp.ffn * _F32
    residual = chunk * 3 * hp.width * _F32
    return int(1.1 * (masks + max(attention, ffn) + residual))


@dataclass(frozen=True)
class MemoryProfile:
    """A model's memory, part by part, from its header: what any stage of it will hold."""

    layer_bytes: tuple[int, ...]
    """Stored bytes of each layer's tensors (quantizations differ from layer to layer)."""
    layer_params: tuple[int, ...]
    """Values of each layer's tensors one token computes with (about half its floating-point operations):
    of a mixture of experts, only its ``n_expert_used`` experts' share (its bytes count every expert)."""
    kv_bytes_per_layer: int
    """One layer's KV cache for one session at the profiled context (f16, rounded up to 256 tokens)."""
    embed_bytes: int
    """Token embeddings (first stage)."""
    head_bytes: int
    """Output norm, head and its bias (last stage); the embeddings again when they are tied."""
    head_params: int
    rope_bytes: int
    """Rope frequency factors (every stage, when the model has them)."""
    compute_bytes: int
    """Compute buffers of one stage for a full prompt chunk (:func:`compute_bytes`, without logits)."""
    logits_bytes: int
    """The last stage's extra compute buffer: one row of logits."""

    tied: bool = False
    """The head is the embedding table."""

    def stage(self, start: int, end: int, first: bool, last: bool) -> int:
        """Bytes of a stage holding layers [start, end), with embeddings and/or head."""
        total = sum(self.layer_bytes[start:end]) + (end - start) * self.kv_bytes_per_layer
        total += self.rope_bytes + self.compute_bytes
        if first:
            total += self.embed_bytes
        if last:
            total += self.head_bytes + self.logits_bytes
            if first and self.tied:
                total -= self.embed_bytes  # one table, mapped once
        return total


def _active(hp: HParams, name: str, n_elements: int) -> int:
    """The values of tensor ``name`` one token multiplies by: a stack of experts, only the chosen ones."""
    return n_elements * hp.n_expert_used // hp.n_expert if name.endswith("_exps.weight") else n_elements


def memory_profile(reader: GGUFFile, hp: HParams, context: int, chunk: int = CHUNK) -> MemoryProfile:
    """The :class:`MemoryProfile` of the model behind ``reader`` for sessions of ``context`` tokens.

    ``chunk``: the most prompt tokens a stage gets in one call (a split's stages get the lane's
    prefill chunks, a whole-model engine up to :data:`CHUNK`).
    """
    plan = plan_stage(reader, hp, 0, hp.n_layers)
    assert plan.embed is not None and plan.head is not None and plan.output_norm is not None
    head = [plan.head, plan.output_norm] + ([plan.head_bias] if plan.head_bias is not None else [])
    return MemoryProfile(
        layer_bytes=tuple(sum(t.nbytes for t in layer.values()) for layer in plan.layers),
        layer_params=tuple(sum(_active(hp, name, t.n_elements) for name, t in layer.items()) for layer in plan.layers),
        kv_bytes_per_layer=kv_bytes_per_token(1, hp.k_width, v_width=hp.v_width) * padded(context),
        embed_bytes=plan.embed.nbytes,
        head_bytes=sum(t.nbytes for t in head),
        head_params=plan.head.n_elements,
        rope_bytes=plan.rope_freqs.nbytes if plan.rope_freqs is not None else 0,
        compute_bytes=compute_bytes(hp, context, chunk),
        logits_bytes=hp.vocab * _F32,
        tied=plan.tied,
    )


def estimate_memory(
    gguf_path: str | Path | GGUFFile,
    layer_start: int,
    layer_end: int,
    context: int,
    first: bool | None = None,
    last: bool | None = None,
    hp: HParams | None = None,
) -> int:
    """Bytes for layers [layer_start, layer_end): stored tensors, one session's KV at ``context`` tokens, compute.

    ``first`` adds the token embeddings and ``last`` the output norm and head; by default they follow
    the range (layer 0 / the final layer). A tied table on a first-and-last stage counts once.
    ``gguf_path`` may be an already-open :class:`GGUFFile` (``hp`` its hparams) so that several
    estimates read the header once. Raises :class:`UnsupportedModel` for a model the runtime cannot run.
    """
    reader = gguf_path if isinstance(gguf_path, GGUFFile) else GGUFFile(gguf_path)
    hp = read_hparams(reader) if hp is None else hp
    plan_stage(reader, hp, layer_start, layer_end)  # refuses a bad range or model with its own message
    first = layer_start == 0 if first is None else first
    last = layer_end == hp.n_layers if last is None else last
    return memory_profile(reader, hp, context).stage(layer_start, layer_end, first, last)
