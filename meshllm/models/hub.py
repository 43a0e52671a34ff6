"""Hugging Face references: ``hf:ORG/REPO/FILE.gguf`` and ``hf:ORG/REPO:QUANT``, downloaded into the library.

``huggingface_hub`` does the talking: it builds the file URL against ``HF_ENDPOINT``, sends
``HF_TOKEN`` (or the saved login), reads the file's metadata (size, and for LFS files the sha256 as
its ETag), lists the repository to match ``:QUANT`` and refuses in offline mode
(``HF_HUB_OFFLINE``). The bytes come in 4 MiB range requests, several at once
(``models/hub_fetch.py``), into ``models/incoming/<etag>.part``; the digests of the pieces written
are kept beside it, so an interrupted pull resumes with the pieces still missing. A file that
changes on the hub while it downloads (a new ETag) is caught and the download starts over from the
new version. The finished file is hashed, checked against the hub's sha256, and moved into the
library under its id. A split's stages fetch only their own ranges (``models/hub_stage.py``).

A reference already in the library (the same repository and file) resolves without any network
call, so a second pull is instant and works offline.
"""

from __future__ import annotations

import hashlib
import os
import re
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from meshllm.models.hub_fetch import (
    HubError,
    HubFile,
    HubFileChanged,
    PieceBook,
    Report,
    fetch_pieces,
    hub_errors,
    locate,
    pieces_of,
    pwrite_all,
)
from meshllm.models.library import Library, LibraryEntry
from meshllm.models.refs import ModelNotFound, file_sha256, model_id_for

__all__ = ["HubError", "HubRef", "Report", "cached", "is_hub_ref", "parse_hub_ref", "pull"]

HF_PREFIX = "hf:"
_REPO = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$")
_SHARD = re.compile(r"-\d{5}-of-\d{5}\.gguf$", re.IGNORECASE)
RESTARTS = 3
"""Versions a download follows when the file changes on the hub while it runs, before giving up."""


@dataclass(frozen=True)
class HubRef:
    """A parsed ``hf:`` reference: a repository and either a file in it or a quantization to match."""

    repo: str
    file: str | None = None
    quant: str | None = None

    @property
    def prefix(self) -> str:
        return f"{HF_PREFIX}{self.repo}/"

    def source(self, file: str) -> str:
        """The library ``source`` of a file of this repository."""
        return f"{self.prefix}{file}"


def is_hub_ref(spec: str) -> bool:
    return spec.startswith(HF_PREFIX)


def parse_hub_ref(spec: str) -> HubRef:
    """``hf:ORG/REPO/FILE.gguf``, ``hf:ORG/REPO:QUANT`` or ``hf:ORG/REPO`` (the repository's only GGUF)."""
    body = spec[len(HF_PREFIX):].strip()
    quant = None
    if ":" in body:
        body, quant = body.rsplit(":", 1)
        if not re.fullmatch(r"[A-Za-z0-9_.-]+", quant):
            raise ModelNotFound(f"{spec!r}: {quant!r} is not a quantization name (e.g. Q4_K_M)")
    parts = body.split("/")
    repo, file = "/".join(parts[:2]), "/".join(parts[2:]) or None
    if not _REPO.match(repo) or (file is not None and (not file.lower().endswith(".gguf") or ".." in parts)):
        raise ModelNotFound(f"{spec!r} is not a Hugging Face reference",
                            hint="write hf:ORG/REPO/FILE.gguf or hf:ORG/REPO:QUANT")
    if file is not None and quant is not None:
        raise ModelNotFound(f"{spec!r} names both a file and a quantization; name one")
    return HubRef(repo, file, quant)


def _matches(file: str, quant: str) -> bool:
    """Whether ``file`` is the ``quant`` quantization (``Q4_K_M`` matches ``model-Q4_K_M.gguf``, any case)."""
    stem = PurePosixPath(file).name[: -len(".gguf")].lower()
    return re.search(rf"(^|[-_.]){re.escape(quant.lower())}($|[-_.])", stem) is not None


def cached(ref: HubRef, library: Library) -> LibraryEntry | None:
    """The library's copy of what ``ref`` names, if it has one (no network)."""
    for entry in library.entries():
        if entry.kind != "whole" or not entry.source.startswith(ref.prefix):
            continue
        file = entry.source[len(ref.prefix):]
        if (ref.file is not None and file == ref.file) or (ref.quant is not None and _matches(file, ref.quant)) or (
                ref.file is None and ref.quant is None):
            return entry
    return None


def pull(spec: str, library: Library, *, report: Report | None = None) -> LibraryEntry:
    """The library entry of ``spec`` (``hf:...``), downloading (or resuming) it when it is not there yet.

    ``report`` sees the download's progress (nothing is printed here).
    """
    ref = parse_hub_ref(spec)
    entry = cached(ref, library)
    if entry is not None:
        library.touch(entry)
        return entry
    from huggingface_hub import constants

    if constants.is_offline_mode():
        raise ModelNotFound(f"{spec} is not in the model library and HF_HUB_OFFLINE is set",
                            hint="unset HF_HUB_OFFLINE and pull it once: `meshllm models pull REF`")
    return _download(ref, hub_file(ref, spec), library, report)


def hub_file(ref: HubRef, spec: str) -> str:
    """The file ``ref`` names: its own, or the one GGUF of the repository that ``ref.quant`` (or nothing) selects."""
    from huggingface_hub import HfApi

    if ref.file is not None:
        return ref.file

    with hub_errors(ref.repo, None):
        files = HfApi().list_repo_files(ref.repo)
    ggufs = [f for f in files if f.lower().endswith(".gguf")]
    chosen = [f for f in ggufs if ref.quant is None or _matches(f, ref.quant)]
    if len(chosen) > 1 and all(_SHARD.search(f) for f in chosen):
        raise ModelNotFound(f"{spec} is a GGUF split into {len(chosen)} shards, which meshllm cannot load yet")
    if len(chosen) != 1:
        listing = ", ".join(ggufs[:12]) or "none"
        what = f"no GGUF matching {ref.quant!r}" if not chosen else f"{len(chosen)} GGUFs"
        raise ModelNotFound(f"{ref.repo} has {what}; its GGUF files: {listing}",
                            hint="name one: hf:ORG/REPO/FILE.gguf or hf:ORG/REPO:QUANT")
    return chosen[0]


def _download(ref: HubRef, file: str, library: Library, report: Report | None) -> LibraryEntry:
    """Every piece of ``file`` into ``models/incoming`` (resuming what a book of its pieces vouches for),
    checked against the hub's sha256, then moved into the library; a new version on the hub mid-way
    starts the download over."""
    for _attempt in range(RESTARTS):
        hub = locate(ref.repo, file)
        tag = hub.model_id or hashlib.sha256(f"{ref.repo}/{file}@{hub.etag}".encode()).hexdigest()
        part = library.incoming(f"{tag}.part")
        book = PieceBook(part.with_name(f"{tag}.pieces"), hub)
        try:
            return _download_version(ref, file, hub, part, book, library, report)
        except HubFileChanged:
            part.unlink(missing_ok=True)  # nothing of the old version is kept
            book.discard()
    raise HubFileChanged(f"{ref.repo}/{file} kept changing on the hub ({RESTARTS} versions while downloading)")


def _download_version(ref: HubRef, file: str, hub: HubFile, part: Path, book: PieceBook, library: Library,
                      report: Report | None) -> LibraryEntry:
    wants = pieces_of(0, hub.size, 0)
    existed = part.exists() and part.stat().st_size == hub.size
    if not existed:
        book.discard()
    library.reserve(hub.size - (part.stat().st_blocks * 512 if existed else 0))
    with part.open("r+b" if existed else "wb") as fh:
        fh.truncate(hub.size)
    fd = os.open(part, os.O_RDWR)
    try:
        have = book.verified(wants, lambda at, n: os.pread(fd, n, at)) if existed else {}
        fetch_pieces(hub, wants, lambda at, data: pwrite_all(fd, data, at), have=have, report=report,
                     on_piece=book.add)
        os.fsync(fd)
    finally:
        os.close(fd)
    digest = file_sha256(part)
    if hub.model_id is not None and digest != hub.model_id:
        part.unlink(missing_ok=True)
        book.discard()
        raise HubError(f"{ref.repo}/{file} arrived with sha256 {digest[:12]}, the hub says {hub.model_id[:12]}",
                       hint="pull it again (the damaged download was deleted)")
    book.discard()
    existing = library.whole(digest)
    if existing is not None:  # the same bytes are already here under another name: keep one copy
        part.unlink()
        return existing
    return library.commit(part, model_id=digest, name=model_id_for(Path(PurePosixPath(file).name)),
                          source=ref.source(file))


def _pwrite(fd: int, data: bytes, at: int) -> None:
    while data:
        n = os.pwrite(fd, data, at)
        data, at = data[n:], at + n
