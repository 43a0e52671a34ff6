"""Which tensors a stage needs (checked from the header alone), then those tensors placed for ggml.

:func:`plan_stage` reads only the tensor directory: the tensors of layers [start, end), token
embeddings on the first stage, output norm and head on the last. It refuses, before anything is
mapped, a missing tensor, an unknown one in a layer (one the model's family does not use), a tensor
type this runtime does not run, and any shape other than the one the hyperparameters imply, so that
no ggml op can later see a shape it would abort on. Which tensors a layer has, and their shapes, is
the family's to say (:class:`~meshllm.engine.ggml.family.Family`).

:func:`load_weights` maps the GGUF read-only and gives each tensor a buffer the way llama.cpp does
(:meth:`Backends.weight_buffer_type`): a tensor the CPU uses as stored points straight into the map
(zero-copy: only pages it reads become resident, so a stage holds its own layers and nothing else); a
tensor the CPU backend repacks, or one that goes to an accelerator, is copied into its buffer once,
and its pages of the map are dropped again.
"""

from __future__ import annotations

import ctypes
import mmap
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType

from meshllm.engine.ggml import lib
from meshllm.engine.ggml.backends import Backends, WeightOp
from meshllm.engine.ggml.errors import UnsupportedModel
from meshllm.engine.ggml.families import family_for
from meshllm.engine.ggml.graph import Graph, T
from meshllm.engine.ggml.hparams import HParams
from meshllm.models.gguf_file import GGUFFile, TensorInfo

MATRIX_TYPES = frozenset({
    lib.F32, lib.F16, lib.BF16, lib.Q4_0, lib.Q4_1, lib.Q5_0, lib.Q5_1, lib.Q8_0,
    lib.Q2_K, lib.Q3_K, lib.Q4_K, lib.Q5_K, lib.Q6_K, lib.IQ4_NL, lib.MXFP4,
})
"""Tensor types accepted for matrices and embeddings: the common llama.cpp quantizations (MXFP4: gpt-oss experts)."""
VECTOR_TYPES = frozenset({lib.F32})
"""Norm weights, biases, attention sinks and rope factors are float32 in every GGUF llama.cpp writes."""
_VECTORS = ("norm.weight", ".bias", "sinks.weight")

def weight_op(name: str) -> WeightOp:
    """How the runtime uses the tensor ``name`` (what decides its buffer type)."""
    if name == "token_embd.weight":
        return "rows"
    if name.endswith((".bias", "sinks.weight")):
        return "add"
    if name == "rope_freqs.weight":
        return "rope"
    if name.endswith("norm.weight"):
        return "mul"
    if name.endswith("_exps.weight"):
        return "matmul_id"
    return "matmul"


@dataclass
class StagePlan:
    """The tensors one stage will use, by name, validated but not yet mapped."""

    start: int
    end: int
    layers: list[dict[str, TensorInfo]]
    """Per layer of the stage, its tensors keyed by the name after ``blk.N.``."""
    embed: TensorInfo | None
    """Token embeddings (first stage only)."""
    output_norm: TensorInfo | None
    head: TensorInfo | None
    """Output projection (last stage only); ``token_embd`` itself when the model ties them."""
    head_bias: TensorInfo | None
    rope_freqs: TensorInfo | None
    """Llama 3 rope frequency factors, shared by all layers."""

    @property
    def tied(self) -> bool:
        """Whether embeddings and head are the same tensor of the file."""
        return self.embed is not None and self.embed is self.head

    def tensors(self) -> list[TensorInfo]:
        """Every distinct tensor of the file the stage reads."""
        out = [t for layer in self.layers for t in layer.values()]
        for t in (self.embed, self.output_norm, self.head, self.head_bias, self.rope_freqs):
            if t is not None and all(t is not o for o in out):
                out.append(t)
        return out

    @property
    def nbytes(self) -> int:
        """Bytes of those tensors as stored in the file (a tied table once)."""
        return sum(t.nbytes for t in self.tensors())


def _check(t: TensorInfo, shape: tuple[int, ...], types: frozenset[int]) -> None:
    if t.type_id not in types:
        name = t.type_name or f"unknown type id {t.type_id}"
        supported = ", ".join(sorted(GGMLQuantizationType(i).name for i in types))
        raise UnsupportedModel(f"tensor {t.name} has type {name}, which the ggml stage runtime does not run "
                               f"(supported here: {supported})")
    if t.shape != shape:
        raise UnsupportedModel(f"tensor {t.name} has shape {list(t.shape)}, expected {list(shape)}")


def plan_stage(reader: GGUFFile, hp: HParams, start: int, end: int) -> StagePlan:
    """Choose and validate the tensors of layers [start, end); raises :class:`UnsupportedModel`."""
    if not 0 <= start < end <= hp.n_layers:
        raise UnsupportedModel(f"layer range [{start}, {end}) is outside the model's {hp.n_layers} layers")
    family = family_for(hp.arch)
    shapes = family.shapes(hp)
    layers = []
    for il in range(start, end):
        required, optional = family.layer_tensors(hp, il)
        prefix = f"blk.{il}."
        present = {t.name.removeprefix(prefix): t for t in reader.tensors if t.name.startswith(prefix)}
        missing = [n for n in required if n not in present]
        if missing:
            raise UnsupportedModel(f"layer {il} lacks {', '.join(prefix + n for n in missing)}")
        unknown = sorted(set(present) - set(required) - set(optional))
        if unknown:
            raise UnsupportedModel(
                f"layer {il} has tensors the ggml stage runtime does not implement: "
                f"{', '.join(prefix + n for n in unknown)}"
            )
        wrong = family.check_layer(set(present))
        if wrong:
            raise UnsupportedModel(f"layer {il}: {wrong}")
        for name, t in present.items():
            _check(t, shapes[name], VECTOR_TYPES if name.endswith(_VECTORS) else MATRIX_TYPES)
        layers.append(present)
    first, last = start == 0, end == hp.n_layers
    embed_t = reader.tensor("token_embd.weight")
    assert embed_t is not None  # read_hparams refuses a model without it
    _check(embed_t, (hp.width, hp.vocab), MATRIX_TYPES)
    embed = embed_t if first else None
    head = output_norm = head_bias = None
    if last:
        output_norm = reader.tensor("output_norm.weight")
        if output_norm is None:
            raise UnsupportedModel("GGUF lacks output_norm.weight")
        _check(output_norm, (hp.width,), VECTOR_TYPES)
        head = reader.tensor("output.weight") or embed_t
        _check(head, (hp.width, hp.vocab), MATRIX_TYPES)
        head_bias = reader.tensor("output.bias")
        if head_bias is not None:
            _check(head_bias, (hp.vocab,), VECTOR_TYPES)
    rope_freqs = reader.tensor("rope_freqs.weight")
    if rope_freqs is not None:
        _check(rope_freqs, (hp.rope.n_rot // 2,), VECTOR_TYPES)
    return StagePlan(start, end, layers, embed, output_norm, head, head_bias, rope_freqs)


@dataclass
class LayerWeights:
    """One block's tensors in ggml, keyed like :attr:`StagePlan.layers` (``attn_q.weight``...)."""

    index: int
    """The layer's number in the model."""
    tensors: dict[str, T]
    on_accelerator: bool = False

    def __getitem__(self, name: str) -> T:
        return self.tensors[name]

    def get(self, name: str) -> T | None:
        return self.tensors.get(name)


@dataclass
class StageWeights:
    """A stage's weights as ggml tensors in backend buffers, and what they cost in memory."""

    layers: list[LayerWeights]
    embed: T | None = None
    output_norm: T | None = None
    head: T | None = None
    head_bias: T | None = None
    rope_freqs: T | None = None
    head_on_accelerator: bool = False
    mapped_bytes: int = 0
    """Bytes used in place from the file map (resident only once read)."""
    copied_bytes: int = 0
    """Bytes copied into host buffers (repacked matrices)."""
    device_bytes: int = 0
    """Bytes uploaded to the accelerator."""
    placement: dict[str, str] = field(default_factory=dict)
    """Tensor name -> buffer type name (``CPU``, ``CPU_REPACK``, ``CUDA0``...)."""
    _close: Callable[[], None] | None = field(default=None, repr=False)

    def close(self) -> None:
        if self._close is not None:
            self._close()
            self._close = None


class _Map:
    """The GGUF mapped read-only, with its address for ggml and page dropping after copies."""

    def __init__(self, path: Path) -> None:
        with path.open("rb") as f:
            self.mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        self._view = np.frombuffer(self.mm, dtype=np.uint8)
        self.base = int(self._view.ctypes.data)
        self.size = len(self.mm)

    def drop(self, offset: int, nbytes: int) -> None:
        """Give back the pages of [offset, offset + nbytes) (a tensor that now lives in another buffer)."""
        if not hasattr(mmap, "MADV_DONTNEED"):
            return
        start = -(-offset // mmap.PAGESIZE) * mmap.PAGESIZE
        end = (offset + nbytes) // mmap.PAGESIZE * mmap.PAGESIZE
        if end > start:
            self.mm.madvise(mmap.MADV_DONTNEED, start, end - start)

    def close(self) -> None:
        del self._view
        self.mm.close()


def load_weights(path: Path, plan: StagePlan, backends: Backends,
                 on_accelerator: Callable[[int], bool] = lambda _il: False) -> StageWeights:
    """Give every tensor of ``plan`` its buffer; ``on_accelerator(layer)`` says which layers go to the GPU.

    The head follows the stage's last layer; token embeddings stay on the CPU (only looked up).
    """
    g = backends.g
    entries: list[tuple[str, TensorInfo, bool]] = []  # (ggml name, file tensor, on accelerator)
    for il, layer in zip(range(plan.start, plan.end), plan.layers, strict=True):
        entries += [(t.name, t, on_accelerator(il)) for t in layer.values()]
    last_on_acc = on_accelerator(plan.end - 1)
    if plan.embed is not None:
        entries.append(("token_embd.weight", plan.embed, False))
    if plan.head is not None:
        assert plan.output_norm is not None
        # a tied head is its own ggml tensor over the same bytes, placed for a matrix product
        entries.append(("output.weight", plan.head, last_on_acc))
        entries.append(("output_norm.weight", plan.output_norm, last_on_acc))
        if plan.head_bias is not None:
            entries.append(("output.bias", plan.head_bias, last_on_acc))
    if plan.rope_freqs is not None:
        entries.append(("rope_freqs.weight", plan.rope_freqs, any(map(on_accelerator, range(plan.start, plan.end)))))

    meta = Graph(g, max_tensors=len(entries))
    fmap = _Map(path)
    buffers: list[int] = []

    def close() -> None:
        for buf in buffers:
            g.ggml_backend_buffer_free(buf)
        buffers.clear()
        meta.close()
        fmap.close()

    try:
        tensors: dict[str, T] = {}
        bufts: dict[str, int] = {}
        for name, info, acc in entries:
            t = meta.new(info.type_id, *info.shape, name=name)
            bufts[name] = backends.weight_buffer_type(t, weight_op(name), acc)
            tensors[name] = t
        weights = StageWeights(layers=[], _close=close)
        by_name = {name: info for name, info, _ in entries}
        in_place = [n for n in tensors if bufts[n] == backends.cpu_buft and _aligned(fmap, by_name[n])]
        if in_place:
            _map_in_place(g, fmap, [(tensors[n], by_name[n]) for n in in_place], buffers)
            weights.mapped_bytes = sum({by_name[n].name: by_name[n].nbytes for n in in_place}.values())
        for buft in dict.fromkeys(bufts[n] for n in tensors if n not in in_place):
            names = [n for n in tensors if n not in in_place and bufts[n] == buft]
            size = _copy_into(backends, fmap, buft, [(tensors[n], by_name[n]) for n in names], buffers)
            if buft == backends.gpu_buft:
                weights.device_bytes += size
            else:
                weights.copied_bytes += size
        weights.placement = {n: backends.buft_name(b) for n, b in bufts.items()}
    except BaseException:
        close()
        raise
    for il, layer in zip(range(plan.start, plan.end), plan.layers, strict=True):
        weights.layers.append(LayerWeights(il, {n: tensors[t.name] for n, t in layer.items()}, on_accelerator(il)))
    weights.embed = tensors.get("token_embd.weight")
    weights.head = tensors.get("output.weight")
    weights.output_norm = tensors.get("output_norm.weight")
    weights.head_bias = tensors.get("output.bias")
    weights.rope_freqs = tensors.get("rope_freqs.weight")
    weights.head_on_accelerator = last_on_acc
    return weights


def _check_size(g: lib.Ggml, t: T, info: TensorInfo) -> None:
    """ggml and the ``gguf`` package must agree on a tensor's size before ggml is pointed at its bytes."""
    if g.ggml_nbytes(t.p) != info.nbytes:
        raise UnsupportedModel(f"tensor {info.name}: ggml sizes it {g.ggml_nbytes(t.p)} bytes, the file {info.nbytes}")


def _aligned(fmap: _Map, info: TensorInfo) -> bool:
    """A tensor can be used in place when its bytes are where ggml's CPU buffers want them (32-byte aligned)."""
    return (fmap.base + info.offset) % 32 == 0


def _map_in_place(g: lib.Ggml, fmap: _Map, items: list[tuple[T, TensorInfo]], buffers: list[int]) -> None:
    """One CPU buffer over the span of the file these tensors occupy; each tensor points at its bytes."""
    first = min(info.offset for _, info in items) // mmap.PAGESIZE * mmap.PAGESIZE
    last = max(info.offset + info.nbytes for _, info in items)
    buf = g.ggml_backend_cpu_buffer_from_ptr(fmap.base + first, last - first)
    if not buf:
        raise UnsupportedModel("ggml could not wrap the mapped model file in a CPU buffer")
    buffers.append(buf)
    g.ggml_backend_buffer_set_usage(buf, lib.BUFFER_USAGE_WEIGHTS)
    for t, info in items:
        _check_size(g, t, info)
        status = g.ggml_backend_tensor_alloc(buf, t.p, ctypes.c_void_p(fmap.base + info.offset))
        if status != lib.STATUS_SUCCESS:
            raise UnsupportedModel(f"ggml refused to place {info.name} in the mapped file (status {status})")


def _copy_into(backends: Backends, fmap: _Map, buft: int, items: list[tuple[T, TensorInfo]],
               buffers: list[int]) -> int:
    """Copy (repack, upload) these tensors from the map into one new buffer of type ``buft``; its size."""
    g = backends.g
    for t, info in items:
        _check_size(g, t, info)
    buf = backends.allocate(buft, [t for t, _ in items], lib.BUFFER_USAGE_WEIGHTS)
    buffers.append(buf)
    for t, info in items:
        g.ggml_backend_tensor_set(t.p, ctypes.c_void_p(fmap.base + info.offset), 0, info.nbytes)
        fmap.drop(info.offset, info.nbytes)
    return int(g.ggml_backend_buffer_get_size(buf))
