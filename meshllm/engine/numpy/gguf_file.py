"""A fast GGUF header reader: metadata and tensor directory, with tensor data memory-mapped.

``gguf.GGUFReader`` builds numpy views for every element of every metadata array; on the default
model (a 262,144-token vocabulary: tokens, scores and types) that takes 15-25 s here before one
tensor can be looked at. This reader decodes scalars and small arrays, steps over large arrays
(the tokenizer's, which llama-cpp-python reads for us), and maps tensor data lazily, so opening a GGUF
to plan or refuse a stage costs milliseconds. Dequantization is still the ``gguf`` package's.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from meshllm.engine.numpy.errors import UnsupportedModel

_MAGIC = b"GGUF"
_ARRAY = 9
_STRING = 8
#: Scalar value types by GGUF type id: struct format.
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
#: Arrays longer than this are skipped, not decoded (hyperparameter arrays are per layer: short).
_MAX_DECODED_ARRAY = 4096


class Skipped:
    """Stands for a large metadata array that was stepped over; only its length is kept."""

    def __init__(self, length: int) -> None:
        self.length = length

    def __len__(self) -> int:
        return self.length


@dataclass(frozen=True)
class TensorInfo:
    """One entry of the tensor directory."""

    name: str
    shape: tuple[int, ...]
    """GGUF order: ``shape[0]`` (ne0) is the contiguous dimension (a matrix's input width)."""
    tensor_type: GGMLQuantizationType
    offset: int
    """Absolute byte offset of the data in the file."""
    file: GGUFFile

    @property
    def n_elements(self) -> int:
        return int(np.prod(self.shape))

    @property
    def nbytes(self) -> int:
        """Bytes of the stored (possibly quantized) data."""
        block, size = GGML_QUANT_SIZES[self.tensor_type]
        return self.n_elements // block * size

    @property
    def data(self) -> np.ndarray:
        """The raw data as rows of bytes, [rows..., bytes per row] (what ``gguf.quants.dequantize`` takes)."""
        block, size = GGML_QUANT_SIZES[self.tensor_type]
        raw = self.file.mapped[self.offset : self.offset + self.nbytes]
        return raw.reshape(*reversed(self.shape[1:]), self.shape[0] // block * size)


class GGUFFile:
    """Metadata (``fields``) and tensor directory (``tensors``) of the GGUF at ``path``."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.fields: dict[str, Any] = {}
        self.tensors: list[TensorInfo] = []
        with open(self.path, "rb") as f:
            self._f = f
            if f.read(4) != _MAGIC:
                raise UnsupportedModel(f"{self.path} is not a GGUF file")
            version, n_tensors, n_kv = struct.unpack("<IQQ", f.read(20))
            if version < 2:
                raise UnsupportedModel(f"{self.path}: GGUF version {version} is too old")
            for _ in range(n_kv):
                key = self._string()
                self.fields[key] = self._value(self._unpack("I"))
            directory = []
            for _ in range(n_tensors):
                name = self._string()
                ndim = self._unpack("I")
                shape = struct.unpack(f"<{ndim}Q", f.read(8 * ndim))
                ttype, offset = struct.unpack("<IQ", f.read(12))
                directory.append((name, shape, ttype, offset))
            align = int(self.fields.get("general.alignment", 32))
            start = -(-f.tell() // align) * align
        del self._f
        for name, shape, ttype, offset in directory:
            try:
                qtype = GGMLQuantizationType(ttype)
            except ValueError:
                raise UnsupportedModel(f"tensor {name} has unknown type id {ttype}") from None
            self.tensors.append(TensorInfo(name, tuple(int(d) for d in shape), qtype, start + offset, self))

    @cached_property
    def mapped(self) -> np.memmap:
        """The whole file, memory-mapped read-only (pages are read only when a tensor is used)."""
        return np.memmap(self.path, dtype=np.uint8, mode="r")

    def _unpack(self, fmt: str) -> Any:
        size = struct.calcsize("<" + fmt)
        return struct.unpack("<" + fmt, self._f.read(size))[0]

    def _string(self) -> str:
        return self._f.read(self._unpack("Q")).decode("utf-8", errors="replace")

    def _value(self, vtype: int) -> Any:
        if vtype == _STRING:
            return self._string()
        if vtype in _SCALARS:
            return self._unpack(_SCALARS[vtype])
        if vtype != _ARRAY:
            raise UnsupportedModel(f"{self.path}: unknown metadata value type {vtype}")
        etype, count = struct.unpack("<IQ", self._f.read(12))
        if etype in _SCALARS:
            fmt = _SCALARS[etype]
            size = struct.calcsize("<" + fmt)
            if count > _MAX_DECODED_ARRAY:
                self._f.seek(size * count, 1)
                return Skipped(count)
            return list(struct.unpack(f"<{count}{fmt}", self._f.read(size * count)))
        if etype == _STRING:
            if count <= _MAX_DECODED_ARRAY:
                return [self._string() for _ in range(count)]
            for _ in range(count):
                self._f.seek(self._unpack("Q"), 1)
            return Skipped(count)
        raise UnsupportedModel(f"{self.path}: metadata arrays of type {etype} are not supported")
