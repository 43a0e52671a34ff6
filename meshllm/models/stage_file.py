"""A stage's own GGUF: the model's header and only the tensors of layers ``[a, b)``.

A worker that hosts layers it has no file for stores what the stage runtime reads and nothing
more: the model's metadata (copied verbatim, plus ``meshllm.stage.*`` keys naming the model and the
range), a tensor directory of the stage's tensors (those ``plan_stage`` picks: its layers, the
embeddings on the first stage, the output norm and head on the last, rope factors), and their bytes
— whole spans of the manifest, so every piece is checked as it lands. The runtime then loads the
file like any GGUF, for that range.

One wrinkle: the runtime reads the vocabulary size from ``token_embd.weight``'s shape, on every
stage. A stage that does not use the table keeps its directory entry (key
``meshllm.stage.shape_only`` names it) with its bytes in a hole past the end of the data: the file
is sparse there, so the table takes no disk space and is never read (only the first stage, which
stores it, looks tokens up).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

from meshllm.engine.ggml.hparams import read_hparams
from meshllm.engine.ggml.weights import plan_stage
from meshllm.models.gguf_file import GGUFFile, TensorInfo
from meshllm.models.manifest import BadManifest, Manifest, Piece
from meshllm.models.metadata import GGUF_MAGIC

KEY_MODEL = "meshllm.stage.model"
KEY_NAME = "meshllm.stage.name"
KEY_START = "meshllm.stage.layer_start"
KEY_END = "meshllm.stage.layer_end"
KEY_SHAPE_ONLY = "meshllm.stage.shape_only"
SHAPE_ONLY = "token_embd.weight"

_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")
_STRING, _UINT32, _ARRAY = 8, 4, 9
_KV_START = 24
"""Magic, version, tensor count and key count come first; the key-value section follows."""


@dataclass(frozen=True)
class Layout:
    """Where the spans of a transfer go in the file being written, and what else that file holds.

    A whole file is the manifest's spans at their own offsets; a stage file is a header of its own,
    then its spans one after another.
    """

    model: str
    placements: dict[int, int]
    """Manifest span index -> offset of its first byte in the output file."""
    size: int
    """Length of the output file (a stage file's shape-only table lies in a hole before it)."""
    header: bytes | None = None
    """The stage file's own header, written at offset 0 (None: the header is span 0, fetched)."""
    layers: tuple[int, int] | None = None
    fetch_bytes: int = 0
    """Bytes the transfer must fetch (the spans placed)."""

    def dest(self, piece: Piece, manifest: Manifest) -> int:
        """Offset in the output file of ``piece``'s first byte."""
        return self.placements[piece.span] + piece.offset - manifest.spans[piece.span].offset


def whole_layout(manifest: Manifest) -> Layout:
    """Every span at its own offset: the output is the model file itself."""
    return Layout(model=manifest.model, placements={i: s.offset for i, s in enumerate(manifest.spans)},
                  size=manifest.size, fetch_bytes=manifest.size)


def stage_tensors(header: bytes, manifest: Manifest, start: int, end: int) -> tuple[GGUFFile, list[TensorInfo]]:
    """The model's header parsed, and the tensors layers ``[start, end)`` need (the runtime's own choice).

    Raises :class:`~meshllm.engine.ggml.errors.UnsupportedModel` for a model or range the runtime
    refuses, and :class:`~meshllm.models.metadata.NotGGUF` for a damaged header.
    """
    reader = GGUFFile(f"model {manifest.model[:12]}", header=header, size=manifest.size)
    hp = read_hparams(reader)
    return reader, plan_stage(reader, hp, start, end).tensors()


def stage_layout(manifest: Manifest, header: bytes, start: int, end: int, name: str = "") -> Layout:
    """The layout of the stage file for layers ``[start, end)``, from the model's verified header.

    ``name`` (the model's API name) is recorded with the id and the range.
    """
    reader, needed = stage_tensors(header, manifest, start, end)
    spans = manifest.spans_for([(t.offset, t.nbytes) for t in needed])
    align = reader.alignment
    rel: dict[int, int] = {}
    at = 0
    for i in spans:
        rel[i] = at
        at = _align(at + manifest.spans[i].length, align)
    entries = []
    for t in needed:
        i = next((i for i in spans if manifest.spans[i].offset <= t.offset < manifest.spans[i].end), None)
        if i is None or t.offset + t.nbytes > manifest.spans[i].end:
            raise BadManifest(f"tensor {t.name} does not lie inside one span of the manifest")
        entries.append((t, rel[i] + t.offset - manifest.spans[i].offset))
    entries.sort(key=lambda entry: entry[1])  # llama.cpp reads tensor data in directory order
    shape_only = []
    table = reader.tensor(SHAPE_ONLY)
    if table is not None and all(t is not table for t in needed):
        shape_only.append(SHAPE_ONLY)
        entries.append((table, at))
    extra = (_kv_string(KEY_MODEL, manifest.model) + _kv_string(KEY_NAME, name) + _kv_u32(KEY_START, start)
             + _kv_u32(KEY_END, end) + _kv_strings(KEY_SHAPE_ONLY, shape_only))
    directory = b"".join(_tensor_entry(t, offset) for t, offset in entries)
    head = (GGUF_MAGIC + _U32.pack(reader.version) + _U64.pack(len(entries)) + _U64.pack(reader.n_kv + 5)
            + header[_KV_START : reader.kv_end] + extra + directory)
    data_start = _align(len(head), align)
    head += bytes(data_start - len(head))
    size = data_start + at + (table.nbytes if shape_only and table is not None else 0)
    return Layout(model=manifest.model, placements={i: data_start + r for i, r in rel.items()}, size=size,
                  header=head, layers=(start, end),
                  fetch_bytes=sum(manifest.spans[i].length for i in spans))


def stage_range(reader: GGUFFile) -> tuple[str, str, int, int] | None:
    """``(model id, name, layer_start, layer_end)`` of a stage file, or None for an ordinary GGUF."""
    model, name, start, end = (reader.fields.get(k) for k in (KEY_MODEL, KEY_NAME, KEY_START, KEY_END))
    if isinstance(model, str) and isinstance(name, str) and isinstance(start, int) and isinstance(end, int):
        return model, name, start, end
    return None


def _align(n: int, align: int) -> int:
    return -(-n // align) * align


def _str(text: str) -> bytes:
    raw = text.encode()
    return _U64.pack(len(raw)) + raw


def _kv_string(key: str, value: str) -> bytes:
    return _str(key) + _U32.pack(_STRING) + _str(value)


def _kv_u32(key: str, value: int) -> bytes:
    return _str(key) + _U32.pack(_UINT32) + _U32.pack(value)


def _kv_strings(key: str, values: list[str]) -> bytes:
    return _str(key) + _U32.pack(_ARRAY) + _U32.pack(_STRING) + _U64.pack(len(values)) + b"".join(map(_str, values))


def _tensor_entry(t: TensorInfo, offset: int) -> bytes:
    dims = b"".join(_U64.pack(d) for d in t.shape)
    return _str(t.name) + _U32.pack(len(t.shape)) + dims + _U32.pack(t.type_id) + _U64.pack(offset)
