"""How much memory a stage will take, from the GGUF header alone, for the split planner.

A stage holds its tensors as float32 after dequantization (4 bytes per value, whatever the file's
quantization) and, per session, a KV cache of ``2 x kv_heads x head_dim x 4`` bytes per layer and
token. Reading the header costs milliseconds, so the planner can price every candidate range.
"""

from __future__ import annotations

from pathlib import Path

from meshllm.engine.numpy.gguf_file import GGUFFile
from meshllm.engine.numpy.hparams import HParams, read_hparams
from meshllm.engine.numpy.weights import plan_stage

_F32 = 4


def estimate_memory(
    gguf_path: str | Path | GGUFFile,
    layer_start: int,
    layer_end: int,
    context: int,
    first: bool | None = None,
    last: bool | None = None,
    hp: HParams | None = None,
) -> int:
    """Bytes for layers [layer_start, layer_end) as float32 plus one session's KV cache of ``context`` tokens.

    ``first`` adds the token embeddings and ``last`` the output norm and head; by default they follow
    the range (layer 0 / the final layer). A tied head shared with the embeddings is counted once.
    ``gguf_path`` may be an already-open :class:`GGUFFile` (``hp`` its hparams) so that several
    estimates read the header once. Raises :class:`UnsupportedModel` for a model the numpy runtime
    cannot run.
    """
    reader = gguf_path if isinstance(gguf_path, GGUFFile) else GGUFFile(gguf_path)
    hp = read_hparams(reader) if hp is None else hp
    plan = plan_stage(reader, hp, layer_start, layer_end)
    by_name = {t.name: t for t in reader.tensors}
    first = layer_start == 0 if first is None else first
    last = layer_end == hp.n_layers if last is None else last
    tensors = {t.name: t for layer in plan.layers for t in layer.values()}
    if plan.rope_freqs is not None:
        tensors[plan.rope_freqs.name] = plan.rope_freqs
    if first:
        tensors["token_embd.weight"] = by_name["token_embd.weight"]
    if last:
        for name in ("output_norm.weight", "output.bias"):
            if name in by_name:
                tensors[name] = by_name[name]
        head = by_name.get("output.weight", by_name["token_embd.weight"])
        tensors[head.name] = head
    weights = sum(t.n_elements for t in tensors.values()) * _F32
    kv = (layer_end - layer_start) * 2 * hp.n_kv_heads * hp.head_dim * _F32 * context
    return weights + kv
