"""GGUF metadata without loading weights.

The node must describe a model (for gossip, the planner and ``/v1/models``) before, or without,
loading it. ``gguf.GGUFReader`` parses every field, including a 262k-entry vocabulary, and every
tensor record into numpy objects: about a second for the default model on a quiet machine and far
more on a busy one. This reader walks the header once, keeps scalar values and only the *length*
of arrays, and stops at the tensor records, so it costs milliseconds and reads a few MB at most.
"""

from __future__ import annotations

import io
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from meshllm.errors import DecodeError

GGUF_MAGIC = b"GGUF"
_MAX_STRING = 16 * 1024 * 1024
"""A longer key or value means a corrupt file (chat templates are a few KB)."""

# GGUF value types: type id -> struct format of one scalar (strings and arrays handled apart).
_SCALARS: dict[int, struct.Struct] = {
    0: struct.Struct("<B"), 1: struct.Struct("<b"), 2: struct.Struct("<H"), 3: struct.Struct("<h"),
    4: struct.Struct("<I"), 5: struct.Struct("<i"), 6: struct.Struct("<f"), 7: struct.Struct("<?"),
    10: struct.Struct("<Q"), 11: struct.Struct("<q"), 12: struct.Struct("<d"),
}
_STRING = 8
_ARRAY = 9
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")


class NotGGUF(DecodeError):
    """The file is not a GGUF model, or its header is damaged."""

    hint = "pass the path of a .gguf model file (llama.cpp's format)"


@dataclass(frozen=True)
class ArrayInfo:
    """An array-valued key, kept as its element type and length (the elements are skipped)."""

    item_type: int
    length: int


@dataclass(frozen=True)
class GGUFMetadata:
    """What the node needs to know about a model file before loading it."""

    path: Path
    file_size: int
    """Bytes on disk (a lower bound for the memory the weights need)."""
    version: int
    architecture: str
    """``general.architecture``: ``llama``, ``gemma3``, ``qwen2``..."""
    name: str
    """``general.name`` if present, else the file stem."""
    block_count: int
    """Transformer layers (what a layer split divides)."""
    context_length: int
    """Trained context length; the engine may use less."""
    embedding_length: int
    """Hidden width (the size of one activation row between stages)."""
    vocab_size: int
    tensor_count: int
    chat_template: str | None
    """``tokenizer.chat_template``; ``None`` when the model brings none (e.g. base models)."""
    file_type: int | None
    """``general.file_type`` (llama.cpp's ``LLAMA_FTYPE``: 0 f32, 1 f16, 15 Q4_K_M...)."""
    fields: dict[str, Any]
    """Every key: scalars as values, arrays as :class:`ArrayInfo`."""

    @property
    def has_chat_template(self) -> bool:
        """Whether chat prompts can be rendered from the file alone."""
        return bool(self.chat_template)

    @property
    def family(self) -> str:
        """Architecture family without its generation number (``gemma3`` -> ``gemma``)."""
        return family_of(self.architecture)


def family_of(architecture: str) -> str:
    """Architecture family without its generation number (``gemma3`` -> ``gemma``)."""
    return architecture.rstrip("0123456789") or architecture


class _Reader:
    """Little-endian reads that fail as :class:`NotGGUF` instead of ``struct.error``."""

    def __init__(self, fh: BinaryIO, path: Path, size: int) -> None:
        self._fh = fh
        self._path = path
        self._size = size

    def exact(self, n: int) -> bytes:
        data = self._fh.read(n)
        if len(data) != n:
            raise NotGGUF(f"{self._path}: truncated GGUF header")
        return data

    def unpack(self, fmt: struct.Struct) -> Any:
        return fmt.unpack(self.exact(fmt.size))[0]

    def string(self) -> str:
        n = self.unpack(_U64)
        if n > _MAX_STRING:
            raise NotGGUF(f"{self._path}: string of {n} bytes in the header")
        return self.exact(n).decode("utf-8", errors="replace")

    def skip(self, n: int) -> None:
        if n > self._size:
            raise NotGGUF(f"{self._path}: a header value of {n} bytes is larger than the file")
        self._fh.seek(n, io.SEEK_CUR)

    def value(self, type_id: int) -> Any:
        if type_id == _STRING:
            return self.string()
        if type_id == _ARRAY:
            item_type = self.unpack(_U32)
            length = self.unpack(_U64)
            self.skip_items(item_type, length)
            return ArrayInfo(item_type, length)
        fmt = _SCALARS.get(type_id)
        if fmt is None:
            raise NotGGUF(f"{self._path}: unknown GGUF value type {type_id}")
        return self.unpack(fmt)

    def skip_items(self, item_type: int, length: int) -> None:
        if item_type in _SCALARS:
            self.skip(_SCALARS[item_type].size * length)
        elif item_type == _STRING:
            for _ in range(length):
                self.skip(self.unpack(_U64))
        elif item_type == _ARRAY:
            for _ in range(length):
                inner = self.unpack(_U32)
                self.skip_items(inner, self.unpack(_U64))
        else:
            raise NotGGUF(f"{self._path}: unknown GGUF array item type {item_type}")


def read_metadata(path: str | Path) -> GGUFMetadata:
    """Read a GGUF file's header; raise :class:`NotGGUF` if it is not one.

    Only GGUF v2 and v3 (little-endian) exist in practice; v1 files predate llama.cpp's current
    loader, which refuses them too.
    """
    path = Path(path)
    try:
        size = path.stat().st_size
        with path.open("rb") as raw:
            fh = io.BufferedReader(raw, buffer_size=1 << 20)  # type: ignore[arg-type]
            r = _Reader(fh, path, size)
            if r.exact(4) != GGUF_MAGIC:
                raise NotGGUF(f"{path} is not a GGUF file (bad magic)")
            version = r.unpack(_U32)
            if version not in (2, 3):
                raise NotGGUF(f"{path}: unsupported GGUF version {version}",
                              hint="convert the model with a current llama.cpp")
            tensor_count = r.unpack(_U64)
            kv_count = r.unpack(_U64)
            if kv_count > 1_000_000:
                raise NotGGUF(f"{path}: implausible key count {kv_count}")
            fields = {r.string(): r.value(r.unpack(_U32)) for _ in range(kv_count)}
    except OSError as exc:
        raise NotGGUF(f"cannot read {path}: {exc.strerror or exc}") from exc
    except RecursionError:
        raise NotGGUF(f"{path}: arrays nested too deep in the GGUF header") from None
    return _describe(path, size, version, tensor_count, fields)


def _describe(path: Path, size: int, version: int, tensor_count: int, fields: dict[str, Any]) -> GGUFMetadata:
    arch = fields.get("general.architecture")
    if not isinstance(arch, str):
        raise NotGGUF(f"{path}: no general.architecture key")

    def arch_int(key: str) -> int:
        value = fields.get(f"{arch}.{key}", 0)
        return int(value) if isinstance(value, int | float) else 0

    tokens = fields.get("tokenizer.ggml.tokens")
    vocab = tokens.length if isinstance(tokens, ArrayInfo) else arch_int("vocab_size")
    template = fields.get("tokenizer.chat_template")
    file_type = fields.get("general.file_type")
    return GGUFMetadata(
        path=path,
        file_size=size,
        version=version,
        architecture=arch,
        name=str(fields.get("general.name") or path.stem),
        block_count=arch_int("block_count"),
        context_length=arch_int("context_length"),
        embedding_length=arch_int("embedding_length"),
        vocab_size=vocab,
        tensor_count=tensor_count,
        chat_template=template if isinstance(template, str) and template else None,
        file_type=file_type if isinstance(file_type, int) else None,
        fields=fields,
    )
