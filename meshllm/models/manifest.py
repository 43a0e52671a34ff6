"""A model's manifest: what every byte of its GGUF must hash to, piece by piece.

A model is named by the sha256 of its file (its *id*), but a whole-file hash can only be checked
once the whole file is here, and a stage needs only some of it. The manifest cuts the file into
**spans**: the header (everything before the first tensor), then one span per run of tensors that
belong together (the tensors of one layer, or one global tensor: embeddings, output norm, head), so
that a stage's tensors are exactly a set of spans. Spans tile the file, so header + all spans is the
whole file byte for byte. Each span is hashed in pieces of :data:`PIECE` bytes, the unit a transfer
requests and checks: a peer that sends one bad piece is caught within that piece.

The coordinator of a split builds the manifest from its own file, signs it with its node key
(domain ``model-manifest``) and sends it with each stage request; a worker checks every piece it
receives against it. A whole-model fetch has no coordinator: its manifest comes from a holder and is
trusted only once the assembled file hashes to the model id (see ``models/transfer.py``).
"""

from __future__ import annotations

import hashlib
import itertools
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

import msgspec
from msgspec import Meta
from nacl.signing import SigningKey

from meshllm.errors import DecodeError, VerificationError
from meshllm.identity.ids import node_public_key
from meshllm.identity.signing import decode_signed, decode_struct, sign, verify
from meshllm.models.gguf_file import GGUFFile

PIECE = 4 << 20
"""Bytes per hashed piece: a transfer's unit of request and verification."""
MANIFEST_DOMAIN = "model-manifest"
MAX_FILE = 1 << 44
"""16 TiB: far above any GGUF, and below what a piece index or an offset in msgpack can express."""
MAX_SPANS = 1 << 16
MAX_MANIFEST = 8 << 20
"""Signed manifests above this are refused (a 20 GB model's is about 200 KB)."""
MODEL_ID = re.compile(r"^[0-9a-f]{64}$")

Digest = Annotated[bytes, Meta(min_length=32, max_length=32)]


class BadManifest(VerificationError):
    """A manifest that does not describe a file consistently, or does not match what it should."""

    hint = "the coordinator's or holder's model file may be damaged; compare `meshllm models list` on both"


class Span(msgspec.Struct, frozen=True, array_like=True):
    """Bytes ``[offset, offset + length)`` of the file, hashed per :data:`PIECE`."""

    offset: Annotated[int, Meta(ge=0, lt=MAX_FILE)]
    length: Annotated[int, Meta(ge=1, lt=MAX_FILE)]
    pieces: list[Digest]

    @property
    def end(self) -> int:
        return self.offset + self.length


class Manifest(msgspec.Struct, frozen=True, kw_only=True):
    """Every span of one model file; ``spans[0]`` is the header."""

    model: Annotated[str, Meta(pattern=MODEL_ID.pattern)]
    """The model id: sha256 (hex) of the whole file."""
    size: Annotated[int, Meta(ge=1, lt=MAX_FILE)]
    piece_size: Annotated[int, Meta(ge=1 << 16, le=1 << 26)]
    spans: Annotated[list[Span], Meta(min_length=1, max_length=MAX_SPANS)]

    def validate(self) -> None:
        """Spans tile ``[0, size)`` and each has one digest per piece; :class:`BadManifest` if not."""
        if self.piece_size & (self.piece_size - 1):
            raise BadManifest(f"piece size {self.piece_size} is not a power of two")
        at = 0
        for i, span in enumerate(self.spans):
            if span.offset != at:
                raise BadManifest(f"span {i} starts at {span.offset}, expected {at}")
            if len(span.pieces) != -(-span.length // self.piece_size):
                raise BadManifest(f"span {i} of {span.length} bytes has {len(span.pieces)} piece digests")
            at = span.end
        if at != self.size:
            raise BadManifest(f"spans end at {at}, the file is {self.size} bytes")

    @property
    def header(self) -> Span:
        return self.spans[0]

    def pieces(self, index: int) -> Iterator[Piece]:
        """The pieces of span ``index``, in order."""
        span = self.spans[index]
        for k, digest in enumerate(span.pieces):
            offset = span.offset + k * self.piece_size
            yield Piece(index, offset, min(self.piece_size, span.end - offset), digest)

    def spans_for(self, ranges: list[tuple[int, int]]) -> list[int]:
        """Indices of the data spans that hold any byte of the ``(offset, length)`` ranges (sorted)."""
        out: set[int] = set()
        for offset, length in ranges:
            for i, span in enumerate(self.spans[1:], start=1):
                if span.offset < offset + length and offset < span.end:
                    out.add(i)
        return sorted(out)


@dataclass(frozen=True)
class Piece:
    """One verifiable unit: bytes ``[offset, offset + length)`` of the file, of span ``span``."""

    span: int
    offset: int
    length: int
    digest: bytes

    def check(self, data: bytes) -> bool:
        return len(data) == self.length and hashlib.sha256(data).digest() == self.digest


def span_bounds(reader: GGUFFile) -> list[int]:
    """Start offsets of the spans of a GGUF: 0 (the header), then each run of tensors of one group."""
    tensors = sorted(reader.tensors, key=lambda t: t.offset)
    starts = [0]
    previous: str | None = None
    for t in tensors:
        group = _group(t.name)
        if group != previous and t.offset > starts[-1]:
            starts.append(t.offset)
        previous = group
    return starts


def _group(name: str) -> str:
    """Tensors of one layer (``blk.N.*``) belong together; every other tensor stands alone."""
    if name.startswith("blk."):
        return name.split(".", 2)[1]
    return name


def build_manifest(path: Path, piece_size: int = PIECE, progress: Callable[[int], None] | None = None) -> Manifest:
    """Hash the GGUF at ``path`` into a manifest (one sequential read; also yields the model id).

    ``progress(bytes_read)`` is called as the file is read (a multi-GB file takes a while).
    """
    reader = GGUFFile(path)
    bounds = [*span_bounds(reader), reader.size]
    whole = hashlib.sha256()
    spans = []
    done = 0
    with path.open("rb") as fh:
        for start, end in itertools.pairwise(bounds):
            digests = []
            at = start
            while at < end:
                data = fh.read(min(piece_size, end - at))
                if not data:
                    raise BadManifest(f"{path} shrank while it was hashed")
                whole.update(data)
                digests.append(hashlib.sha256(data).digest())
                at += len(data)
                done += len(data)
                if progress is not None:
                    progress(done)
            spans.append(Span(start, end - start, digests))
    manifest = Manifest(model=whole.hexdigest(), size=reader.size, piece_size=piece_size, spans=spans)
    manifest.validate()
    return manifest


def sign_manifest(key: SigningKey, manifest: Manifest) -> bytes:
    """The manifest signed by a node key (what a coordinator sends with a stage request)."""
    return msgspec.msgpack.encode(sign(key, MANIFEST_DOMAIN, manifest))


def open_manifest(raw: bytes, signer_node_id: str, model: str | None = None) -> Manifest:
    """The manifest in ``raw`` if ``signer_node_id`` signed it (and it names ``model``); else an error.

    Raises :class:`~meshllm.errors.DecodeError` for bytes that are not a manifest and a
    :class:`~meshllm.errors.VerificationError` for a wrong signer, a bad signature, another model
    or spans that do not tile the file.
    """
    if len(raw) > MAX_MANIFEST:
        raise DecodeError(f"a manifest of {len(raw)} bytes exceeds the {MAX_MANIFEST}-byte cap")
    signed = decode_signed(raw, what="model manifest")
    manifest = verify(signed, MANIFEST_DOMAIN, Manifest, signer=node_public_key(signer_node_id))
    manifest.validate()
    if model is not None and manifest.model != model:
        raise BadManifest(f"the manifest describes model {manifest.model[:12]}, not {model[:12]}")
    return manifest


def encode_manifest(manifest: Manifest) -> bytes:
    return msgspec.msgpack.encode(manifest)


def decode_manifest(raw: bytes) -> Manifest:
    """An unsigned manifest (the library's own cache); DecodeError/BadManifest if damaged."""
    manifest = decode_struct(raw, Manifest, what="model manifest")
    manifest.validate()
    return manifest
