"""A GGUF's metadata (short arrays decoded) and its tensor directory, read from the header alone.

:func:`meshllm.models.metadata.read_metadata` describes a model for gossip and routing and skips every
array. A stage runtime also needs the per-layer hyperparameter arrays (a sliding-window pattern, head
counts per layer) and the tensor directory: names, shapes, ggml type ids and where each tensor's
bytes lie. This reader uses the same bounded, truncation-safe reads (``metadata._Reader``): any damage
is a :class:`~meshllm.models.metadata.NotGGUF`, never a ``struct.error``, and it decodes only arrays
up to :data:`MAX_DECODED_ARRAY` items, stepping over the tokenizer's (262,144 entries in the default
model), so opening a GGUF costs milliseconds. It never loads tensor data: the runtime maps it.
"""

from __future__ import annotations

import io
import math
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from meshllm.models.metadata import _ARRAY, _SCALARS, _STRING, _U32, _U64, GGUF_MAGIC, ArrayInfo, NotGGUF, _Reader

MAX_DECODED_ARRAY = 4096
"""Arrays longer than this are kept as :class:`ArrayInfo` (hyperparameter arrays are per layer: short)."""
MAX_TENSORS = 1_000_000
MAX_DIMS = 4


@dataclass(frozen=True)
class TensorInfo:
    """One entry of the tensor directory."""

    name: str
    shape: tuple[int, ...]
    """GGUF (ggml) order: ``shape[0]`` is the contiguous dimension (a matrix's input width)."""
    type_id: int
    """ggml type id as stored; :attr:`type_name` is ``None`` for an id the ``gguf`` package does not know."""
    offset: int
    """Absolute byte offset of the data in the file."""

    @property
    def n_elements(self) -> int:
        return math.prod(self.shape)

    @property
    def type_name(self) -> str | None:
        try:
            return GGMLQuantizationType(self.type_id).name
        except ValueError:
            return None

    @property
    def nbytes(self) -> int:
        """Bytes of the stored (possibly quantized) data; 0 for an unknown type."""
        if self.type_name is None:
            return 0
        block, size = GGML_QUANT_SIZES[GGMLQuantizationType(self.type_id)]
        return self.n_elements // block * size


class _ArrayReader(_Reader):
    """:class:`~meshllm.models.metadata._Reader` that decodes short scalar and string arrays."""

    def value(self, type_id: int) -> Any:
        if type_id != _ARRAY:
            return super().value(type_id)
        item_type = self.unpack(_U32)
        length = self.unpack(_U64)
        if length <= MAX_DECODED_ARRAY and item_type in _SCALARS:
            fmt = _SCALARS[item_type]
            return list(struct.unpack(f"<{length}{fmt.format[1:]}", self.exact(fmt.size * length)))
        if length <= MAX_DECODED_ARRAY and item_type == _STRING:
            return [self.string() for _ in range(length)]
        self.skip_items(item_type, length)
        return ArrayInfo(item_type, length)


class GGUFFile:
    """Metadata (``fields``) and tensor directory (``tensors``) of the GGUF at ``path``.

    Raises :class:`NotGGUF` for a file that is not a GGUF, is truncated, or whose directory puts a
    tensor outside the file.
    """

    def __init__(self, path: str | Path, *, header: bytes | None = None, size: int | None = None) -> None:
        """Read the file at ``path``; or, with ``header`` (the file's first bytes) and ``size`` (its
        length), parse a header that arrived from elsewhere (a peer) before the file exists here.
        """
        self.path = Path(path)
        self.fields: dict[str, Any] = {}
        self.tensors: list[TensorInfo] = []
        try:
            if header is not None:
                self.size = len(header) if size is None else size
                fh = io.BufferedReader(io.BytesIO(header))  # type: ignore[arg-type]
                self._read(_ArrayReader(fh, self.path, self.size), fh)
                return
            self.size = self.path.stat().st_size
            with self.path.open("rb") as raw:
                fh = io.BufferedReader(raw, buffer_size=1 << 20)  # type: ignore[arg-type]
                self._read(_ArrayReader(fh, self.path, self.size), fh)
        except OSError as exc:
            raise NotGGUF(f"cannot read {self.path}: {exc.strerror or exc}") from exc
        except RecursionError:
            raise NotGGUF(f"{self.path}: arrays nested too deep in the GGUF header") from None

    def _read(self, r: _ArrayReader, fh: io.BufferedReader) -> None:
        if r.exact(4) != GGUF_MAGIC:
            raise NotGGUF(f"{self.path} is not a GGUF file (bad magic)")
        version = r.unpack(_U32)
        if version not in (2, 3):
            raise NotGGUF(f"{self.path}: unsupported GGUF version {version}")
        self.version = version
        n_tensors, n_kv = r.unpack(_U64), r.unpack(_U64)
        if n_tensors > MAX_TENSORS or n_kv > 1_000_000:
            raise NotGGUF(f"{self.path}: implausible header ({n_tensors} tensors, {n_kv} keys)")
        self.n_kv = n_kv
        for _ in range(n_kv):
            key = r.string()
            self.fields[key] = r.value(r.unpack(_U32))
        self.kv_end = fh.tell()
        """Where the key-value section ends and the tensor directory begins (a stage file copies the keys)."""
        directory = []
        for _ in range(n_tensors):
            name = r.string()
            ndim = r.unpack(_U32)
            if not 1 <= ndim <= MAX_DIMS:
                raise NotGGUF(f"{self.path}: tensor {name} has {ndim} dimensions")
            shape = tuple(r.unpack(_U64) for _ in range(ndim))
            type_id, offset = r.unpack(_U32), r.unpack(_U64)
            if any(d < 1 for d in shape) or math.prod(shape) > 1 << 40:
                raise NotGGUF(f"{self.path}: tensor {name} has shape {shape}")
            directory.append((name, shape, type_id, offset))
        align = self.fields.get("general.alignment", 32)
        if not isinstance(align, int) or align < 1 or align & (align - 1):
            raise NotGGUF(f"{self.path}: bad general.alignment {align!r}")
        self.alignment = align
        self.data_offset = -(-fh.tell() // align) * align
        for name, shape, type_id, offset in directory:
            t = TensorInfo(name, shape, type_id, self.data_offset + offset)
            if t.type_name is not None:
                block = GGML_QUANT_SIZES[GGMLQuantizationType(type_id)][0]
                if shape[0] % block:
                    raise NotGGUF(f"{self.path}: tensor {name} rows of {shape[0]} are not whole {block}-blocks")
                if t.offset + t.nbytes > self.size:
                    raise NotGGUF(f"{self.path}: tensor {name} lies past the end of the file (truncated?)")
            self.tensors.append(t)
        self._by_name = {t.name: t for t in self.tensors}

    def tensor(self, name: str) -> TensorInfo | None:
        """The directory entry called ``name``, if any."""
        return self._by_name.get(name)
