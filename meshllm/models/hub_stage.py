"""Split stages straight from the hub: each node of a chain fetches only its own ranges of an ``hf:`` GGUF.

No node downloads the whole file. The **coordinator** (:class:`HubModel`) fetches the header by
range (growing the read until the tensor directory parses) to plan, then, once the plan gives it
its layers, the tensors of those layers (and the embeddings): its copy is a sparse file of the
model's full length with only those bytes written (``models/hub/<id>.gguf``), which it loads its
first stage from like any GGUF. It is not a library entry: the node never offers it to peers.

It then asks each worker to host its range with a :class:`HubSource` signed by its node key in
place of a manifest: the file's reference, the version (size and ETag, the file's sha256) and the
sha256 of every piece the coordinator fetched. A **worker** (:func:`fetch_stage`) checks that the
hub still has that version (:class:`HubFileChanged` refuses the stage otherwise), fetches the
header and its own layers' pieces by range, cross-checks every piece the coordinator also holds,
and every other piece against the signed manifest of a peer that offers the whole file, if one
does (a piece that disagrees is refetched and the bad source named, ``models/hub_fetch.py``), and
writes a stage file (``models/stage_file.py``) into its library, resumable from a book of the
pieces written.

The whole file's sha256 cannot be checked from a part of it: what vouches for a piece is that the
hub served it under the pinned version, and that every other holder of the same piece agrees.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import itertools
import logging
import os
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Annotated

import msgspec
from msgspec import Meta
from nacl.signing import SigningKey

from meshllm.errors import DecodeError, MeshllmError
from meshllm.identity.ids import node_public_key, short
from meshllm.identity.signing import decode_signed, sign, verify
from meshllm.models.gguf_file import GGUFFile
from meshllm.models.hub import RESTARTS, hub_file, parse_hub_ref
from meshllm.models.hub_fetch import (
    Disagreement,
    FetchResult,
    HubError,
    HubFile,
    HubFileChanged,
    PieceBook,
    Report,
    VersionPin,
    Want,
    fetch_pieces,
    get_range,
    locate,
    pieces_of,
    pwrite_all,
)
from meshllm.models.library import Library, LibraryEntry
from meshllm.models.manifest import MAX_MANIFEST, MODEL_ID, PIECE, BadManifest, Manifest, Span, span_bounds
from meshllm.models.metadata import NotGGUF
from meshllm.models.refs import ModelRef, model_id_for
from meshllm.models.stage_file import stage_layout, stage_tensors
from meshllm.models.store import Check, ModelStore
from meshllm.models.transfer import get_manifest, plan_pieces, prepare_output
from meshllm.net import NetError

log = logging.getLogger(__name__)


HUB_SOURCE_DOMAIN = "hub-source"
HEADER_PROBE = 64 << 10
"""First read of a header whose length is not known yet (doubled until the directory parses)."""
MAX_HEADER = 64 << 20
"""Largest header accepted (a 150k-token vocabulary takes about 10 MB): a worker holds it in memory."""
HUB_DIR = "hub"
MANIFEST_HOLDERS = 2
"""Peers offering the whole file that a worker asks for a manifest to cross-check against, in turn."""
MANIFEST_WAIT_S = 10.0

Digest = Annotated[bytes, Meta(min_length=32, max_length=32)]


class HubSource(msgspec.Struct, frozen=True, kw_only=True):
    """Where a worker fetches its stage from the hub, signed by the coordinator (``Host.hub``)."""

    spec: Annotated[str, Meta(min_length=4, max_length=600)]
    """``hf:ORG/REPO/FILE.gguf``."""
    size: Annotated[int, Meta(ge=1, lt=1 << 44)]
    etag: Annotated[str, Meta(pattern=MODEL_ID.pattern)]
    """The version: the file's sha256 as the hub states it (its ETag), which is also the model id."""
    header_length: Annotated[int, Meta(ge=1, le=MAX_HEADER)]
    digests: dict[int, Digest] = {}
    """sha256 of each piece the coordinator fetched, by its offset in the file (the cross-check)."""


def sign_source(key: SigningKey, source: HubSource) -> bytes:
    return msgspec.msgpack.encode(sign(key, HUB_SOURCE_DOMAIN, source))


def open_source(raw: bytes, signer_node_id: str, model: str) -> HubSource:
    """The :class:`HubSource` in ``raw`` if ``signer_node_id`` signed it for ``model``; else an error."""
    if len(raw) > MAX_MANIFEST:
        raise BadManifest(f"a hub source of {len(raw)} bytes exceeds the {MAX_MANIFEST}-byte cap")
    source = verify(decode_signed(raw, what="hub source"), HUB_SOURCE_DOMAIN, HubSource,
                    signer=node_public_key(signer_node_id))
    ref = parse_hub_ref(source.spec)
    if ref.file is None:
        raise BadManifest(f"the hub source names no file: {source.spec!r}")
    if source.etag != model:
        raise BadManifest(f"the hub source is for model {source.etag[:12]}, not {model[:12]}")
    if source.header_length > source.size:
        raise BadManifest("the hub source's header is longer than its file")
    return source


def skeleton(model_id: str, size: int, header: bytes) -> Manifest:
    """The model's spans from its header alone (digests unknown: zeros), to cut pieces and lay out stages."""
    reader = GGUFFile(f"model {model_id[:12]}", header=header, size=size)
    bounds = [*span_bounds(reader), size]
    spans = [Span(a, b - a, [bytes(32)] * -(-(b - a) // PIECE)) for a, b in itertools.pairwise(bounds)]
    manifest = Manifest(model=model_id, size=size, piece_size=PIECE, spans=spans)
    manifest.validate()
    return manifest


def find_header(read: Callable[[int, int], bytes], size: int, name: str) -> tuple[bytes, int]:
    """A GGUF's header (every byte before its first tensor) and the bytes read to find its end.

    ``read(offset, length)`` gives bytes of the file; reads double from :data:`HEADER_PROBE` until
    the tensor directory parses. :class:`NotGGUF` when it does not within :data:`MAX_HEADER`.
    """
    at, data = 0, b""
    want = min(HEADER_PROBE, size)
    while True:
        if want > at:
            data += read(at, want - at)
            at = want
        try:
            bounds = span_bounds(GGUFFile(name, header=data, size=size))
        except NotGGUF:
            if at >= min(size, MAX_HEADER):
                raise
            want = min(at * 2, size, MAX_HEADER)
            continue
        length = bounds[1] if len(bounds) > 1 else size
        if length <= at:
            return data[:length], at
        want = length


def read_header(hub: HubFile) -> tuple[bytes, int]:
    """The header of ``hub``'s file by range requests (all of one version), and the bytes they took."""
    pin = VersionPin(hub)
    return find_header(lambda at, n: get_range(hub, at, n, pin), hub.size, hub.spec)


class HubModel:
    """A coordinator's partial copy of an ``hf:`` model: its header and, on demand, a stage's layers."""

    def __init__(self, hub: HubFile, library: Library) -> None:
        assert hub.model_id is not None
        self.hub = hub
        self.library = library
        self.model_id = hub.model_id
        self.path = library.root / HUB_DIR / f"{self.model_id}.gguf"
        self.book = PieceBook(self.path.with_suffix(".pieces"), hub)
        self.header = b""
        self.manifest: Manifest | None = None
        self.fetched = 0
        """Bytes this node asked of the hub for this model (probes included)."""

    @classmethod
    def open(cls, spec: str, library: Library) -> HubModel:
        """Locate ``spec`` on the hub and have its header here (blocking; resumes a kept copy).

        A file that changes on the hub while its header arrives is opened again at the new version.
        """
        ref = parse_hub_ref(spec)
        file = hub_file(ref, spec)
        for _attempt in range(RESTARTS):
            hub = locate(ref.repo, file)
            if hub.model_id is None:
                raise HubError(f"{hub.spec} has no sha256 on the hub (not an LFS file): its stages cannot be "
                               "fetched by range", hint="pull it whole first: `meshllm models pull REF`, then split it")
            model = cls(hub, library)
            try:
                model._load_header()
            except HubFileChanged:
                model.discard()
                continue
            return model
        raise HubFileChanged(f"{ref.repo}/{file} kept changing on the hub ({RESTARTS} versions while opening it)")

    @property
    def ref(self) -> ModelRef:
        return ModelRef(path=self.path, model_id=model_id_for(Path(PurePosixPath(self.hub.file).name)),
                        sha256=self.model_id)

    def _load_header(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        kept = self.path.exists() and self.path.stat().st_size == self.hub.size
        if kept and 0 in self.book.digests:
            with self.path.open("rb") as fh, contextlib.suppress(NotGGUF):
                header = b""
                header, _ = find_header(lambda at, n: os.pread(fh.fileno(), n, at), self.hub.size, str(self.path))
            wants = pieces_of(0, len(header), 0) if header else []
            if header and len(self.book.verified(wants, lambda at, n: header[at:at + n])) == len(wants):
                self.header, self.manifest = header, skeleton(self.model_id, self.hub.size, header)
                return
        self.book.discard()
        header, fetched = read_header(self.hub)
        self.fetched += fetched
        self.library.reserve(len(header))
        with self.path.open("wb") as fh:
            fh.write(header)
            fh.truncate(self.hub.size)
        for w in pieces_of(0, len(header), 0):
            self.book.add(w.offset, hashlib.sha256(header[w.offset:w.offset + w.length]).digest())
        self.header, self.manifest = header, skeleton(self.model_id, self.hub.size, header)

    def wants(self, start: int, end: int) -> list[Want]:
        """The pieces layers ``[start, end)`` need (their tensors, and the embeddings or head), in place."""
        assert self.manifest is not None
        _, needed = stage_tensors(self.header, self.manifest, start, end)
        spans = self.manifest.spans_for([(t.offset, t.nbytes) for t in needed])
        return [Want(p.offset, p.length, p.offset) for i in spans for p in self.manifest.pieces(i)]

    def ensure(self, start: int, end: int, report: Report | None = None) -> FetchResult:
        """Have layers ``[start, end)`` here (blocking): the pieces not on disk yet are fetched now."""
        wants = self.wants(start, end)
        fd = os.open(self.path, os.O_RDWR)
        try:
            have = self.book.verified(wants, lambda at, n: os.pread(fd, n, at))
            self.library.reserve(sum(w.length for w in wants if w.offset not in have))
            result = fetch_pieces(self.hub, wants, lambda at, data: pwrite_all(fd, data, at), have=have,
                                  report=report, on_piece=self.book.add)
            os.fsync(fd)
        finally:
            os.close(fd)
        self.fetched += result.fetched
        return result

    def discard(self) -> None:
        """Delete the partial copy (the model is to be pulled whole instead)."""
        self.path.unlink(missing_ok=True)
        self.book.discard()

    def source(self) -> HubSource:
        """What a worker needs to fetch its own stage, with the digests of every piece here."""
        return HubSource(spec=self.hub.spec, size=self.hub.size, etag=self.model_id, header_length=len(self.header),
                         digests=dict(self.book.digests))


# -- the worker side ----------------------------------------------------------------------------


@dataclass
class StageFetch:
    """A stage a worker found or fetched from the hub: the library file, and what the fetch cost."""

    entry: LibraryEntry
    fetched: int = 0
    disagreements: list[Disagreement] | None = None


def fetch_stage_blocking(library: Library, source: HubSource, name: str, start: int, end: int, *,
                         check: Check | None = None, reference_name: str = "the coordinator",
                         holders: Mapping[int, tuple[bytes, str]] | None = None,
                         report: Report | None = None, stop: threading.Event | None = None) -> StageFetch:
    """Fetch layers ``[start, end)`` of ``source`` from the hub into a stage file of ``library`` (blocking).

    Every piece is cross-checked with the coordinator's digest (``source``) or, for the pieces it
    lacks, another holder's (``holders``: offset -> digest and the holder's name).
    """
    reference = {offset: digest for offset, (digest, _) in (holders or {}).items()} | source.digests
    names = {offset: holder for offset, (_, holder) in (holders or {}).items() if offset not in source.digests}
    ref = parse_hub_ref(source.spec)
    assert ref.file is not None
    hub = locate(ref.repo, ref.file)
    if hub.etag != source.etag or hub.size != source.size:
        raise HubFileChanged(f"{source.spec} changed on the hub since the coordinator planned the chain "
                             f"(ETag {source.etag[:12]} -> {hub.etag[:12]}, {source.size} -> {hub.size} bytes)")
    header = bytearray(source.header_length)

    def into_header(at: int, data: bytes) -> None:
        header[at:at + len(data)] = data

    first = fetch_pieces(hub, pieces_of(0, source.header_length, 0), into_header, reference=reference,
                         reference_name=reference_name, reference_names=names, stop=stop)
    head = bytes(header)
    if check is not None:
        check(GGUFFile(f"model {source.etag[:12]}", header=head, size=source.size))
    manifest = skeleton(source.etag, source.size, head)
    layout = stage_layout(manifest, head, start, end, name)
    part = library.incoming(f"{source.etag}.{start}-{end}.part")
    book = PieceBook(part.with_name(f"{source.etag}.{start}-{end}.pieces"), hub)
    library.reserve(layout.fetch_bytes + len(layout.header or b""))
    existed = prepare_output(part, layout)
    wants = [Want(p.offset, p.length, layout.dest(p, manifest)) for p in plan_pieces(manifest, layout)]
    fd = os.open(part, os.O_RDWR)
    try:
        have = book.verified(wants, lambda at, n: os.pread(fd, n, at)) if existed else {}
        rest = fetch_pieces(hub, wants, lambda at, data: pwrite_all(fd, data, at), reference=reference,
                            reference_name=reference_name, reference_names=names, have=have, report=report,
                            on_piece=book.add, stop=stop)
        os.fsync(fd)
    finally:
        os.close(fd)
    entry = library.commit(part, model_id=source.etag, name=name, source=source.spec, layers=(start, end))
    book.discard()
    return StageFetch(entry, first.fetched + rest.fetched, first.disagreements + rest.disagreements)


async def holder_digests(store: ModelStore, model_id: str) -> dict[int, tuple[bytes, str]]:
    """Piece digests of ``model_id`` from the manifest of the first peer that offers the whole file and
    sends one (signed by it), with its name; empty when no peer holds the model."""
    for node, addr in store.holders(model_id)[:MANIFEST_HOLDERS]:
        try:
            manifest, _ = await asyncio.wait_for(get_manifest(store.endpoint, node, addr, model_id), MANIFEST_WAIT_S)
        except (MeshllmError, NetError, DecodeError, OSError, TimeoutError) as exc:
            log.info("no manifest of %s from %s to cross-check against: %s", model_id[:12], short(node), exc)
            continue
        name = f"node {short(node)}"
        return {p.offset: (p.digest, name) for i in range(len(manifest.spans)) for p in manifest.pieces(i)}
    return {}


async def fetch_stage(store: ModelStore, source: HubSource, name: str, start: int, end: int, *,
                      coordinator: str, check: Check | None = None) -> StageFetch:
    """The library file holding layers ``[start, end)`` of ``source``'s model: one here already, or
    one fetched now from the hub, its progress in the node's status and events."""
    library = store.library
    found = library.whole(source.etag) or library.stage(source.etag, start, end)
    if found is not None:
        if check is not None:
            await asyncio.to_thread(check, GGUFFile(found.file))
        library.touch(found)
        return StageFetch(found)
    key = f"{source.etag}:{start}-{end}"
    view = store.begin_view(key, source.etag, name, "hub-stage", (start, end))
    store.publish("transfer_started", model=name, id=source.etag, kind="hub-stage", layers=[start, end],
                  holders=[source.spec])
    stop = threading.Event()
    try:
        holders = await holder_digests(store, source.etag)
        done = await asyncio.to_thread(fetch_stage_blocking, library, source, name, start, end, check=check,
                                       reference_name=f"node {short(coordinator)}", holders=holders,
                                       report=store.reporter(view), stop=stop)
    except (MeshllmError, OSError) as exc:
        store.end_view(view, error=str(exc))
        raise
    except asyncio.CancelledError:
        stop.set()
        store.end_view(view, error="cancelled")
        raise
    for d in done.disagreements or []:
        store.publish("hub_piece_disagreed", model=name, id=source.etag, offset=d.offset, length=d.length,
                      bad_source=d.bad)
    store.end_view(view, fetched=done.fetched)
    return done
