"""The model library: every GGUF this node has on disk, indexed by content (sha256), within a disk budget.

A model's **id** is the sha256 of its file (shown as its first 12 hex digits beside its name); its
**name** is the file's stem, the ``model`` API clients send. The library is what lets a node find a
model by id wherever it lives: files it fetched or downloaded itself live in ``<home>/models/``
(``<id>.gguf``; stage files of layer ranges in ``stages/``); the folders listed in ``config.toml``
(``model_dirs``) are indexed in place, and so is any file a node was told to serve by path. Nothing
is found by path from the network: peers name models by id.

The index is one JSON file (``index.json``), read and rewritten under an exclusive ``flock`` so a
running node and ``meshllm models`` commands can share it. Files the library made itself are its to
evict and delete; files in the user's folders are only ever forgotten, never deleted.

**Disk budget** (``models_disk_budget_gb``): before a transfer or download adds bytes, the library
makes room by evicting its own files, least recently used first, stage files before whole models,
files kept for later (a worker's warm spares: ``pin(entry, weak=True)``) only when nothing else
makes room, never a model in use (:meth:`Library.pin`); if that is not enough it refuses with
:class:`DiskBudgetExceeded`. Sizes are the blocks a file really occupies (stage files are sparse).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import threading
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Literal

import msgspec

from meshllm.config import MODEL_HASHES_FILE, load_config, write_private
from meshllm.errors import ConfigError, MeshllmError
from meshllm.models.gguf_file import GGUFFile
from meshllm.models.manifest import MODEL_ID, Manifest, build_manifest, decode_manifest, encode_manifest
from meshllm.models.metadata import GGUF_MAGIC, NotGGUF
from meshllm.models.refs import SHORT_HASH, file_sha256, model_id_for
from meshllm.models.stage_file import stage_range

LIBRARY_DIR = "models"
INDEX_FILE = "index.json"
MIN_PREFIX = 8
"""Shortest id prefix accepted as a reference (32 bits: unambiguous among a node's models)."""
_HEX = re.compile(r"^[0-9a-f]+$")

Kind = Literal["whole", "stage"]


class DiskBudgetExceeded(MeshllmError):
    """The library cannot make room for a file within its disk budget."""

    hint = "raise models_disk_budget_gb in config.toml, or remove models with `meshllm models rm ID`"


class AmbiguousModel(MeshllmError):
    """A name or id prefix matches several models of the library."""

    hint = "name the model by its id (`meshllm models list` shows them)"


class LibraryEntry(msgspec.Struct, kw_only=True):
    """One file of the library."""

    id: str
    """sha256 (hex) of the model file; a stage file carries the id of the model it is part of."""
    name: str
    """The API model id (the original file's stem)."""
    path: str
    size: int
    kind: Kind = "whole"
    layers: tuple[int, int] | None = None
    """A stage file's layer range."""
    source: str = ""
    """Where it came from: ``hf:ORG/REPO/FILE``, ``peer:<node id>``, ``folder``, ``file``."""
    owned: bool = True
    """Made by the library (``<home>/models``): it may evict or delete it."""
    mtime_ns: int = 0
    last_used: float = 0.0

    @property
    def key(self) -> str:
        return self.id if self.layers is None else f"{self.id}:{self.layers[0]}-{self.layers[1]}"

    @property
    def short(self) -> str:
        return self.id[:SHORT_HASH]

    @property
    def file(self) -> Path:
        return Path(self.path)

    def disk_bytes(self) -> int:
        """Bytes the file occupies on disk (a sparse stage file less than its length)."""
        try:
            return self.file.stat().st_blocks * 512
        except OSError:
            return 0


class Library:
    """The models under ``root`` (``<home>/models``) and in ``folders``, by id."""

    def __init__(self, root: Path, folders: Iterable[Path] = (), budget_bytes: int | None = None,
                 hash_cache: Path | None = None) -> None:
        self.root = root
        self.folders = [Path(f).expanduser() for f in folders]
        self.budget_bytes = budget_bytes
        self.hash_cache = hash_cache
        self.pinned: set[str] = set()
        """Keys of entries in use by this process (never evicted)."""
        self.kept: set[str] = set()
        """Keys of entries kept for later by this process (weak pins: evicted only when nothing else makes room)."""
        self._hashing = threading.Lock()
        """Held while a manifest is built: peers asking at once for one model's manifest hash it once."""

    @classmethod
    def for_home(cls, home: Path) -> Library:
        """The library of the node whose home is ``home``, with the folders and budget of its config.toml."""
        config = load_config(home)
        budget = config.models_disk_budget_gb
        return cls(home / LIBRARY_DIR, [Path(d) for d in config.model_dirs],
                   int(budget * 1e9) if budget is not None else None, home / MODEL_HASHES_FILE)

    # -- files ----------------------------------------------------------------------------------

    def path_for(self, model_id: str, layers: tuple[int, int] | None = None) -> Path:
        """Where the library keeps (or will keep) its own copy of a model or of a stage of it."""
        if layers is None:
            return self.root / f"{model_id}.gguf"
        return self.root / "stages" / f"{model_id}.{layers[0]}-{layers[1]}.gguf"

    def incoming(self, name: str) -> Path:
        """A path for a file being written (a download or transfer in progress)."""
        folder = self.root / "incoming"
        folder.mkdir(parents=True, exist_ok=True)
        return folder / name

    # -- the index ------------------------------------------------------------------------------

    @contextlib.contextmanager
    def _locked(self) -> Iterator[dict[str, LibraryEntry]]:
        """The index under an exclusive lock; what the block leaves in the dict is saved."""
        self.root.mkdir(parents=True, exist_ok=True)
        with (self.root / ".lock").open("a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            entries = self._read()
            before = msgspec.json.encode(entries)
            yield entries
            if msgspec.json.encode(entries) != before:
                self._write(entries)

    def _read(self) -> dict[str, LibraryEntry]:
        path = self.root / INDEX_FILE
        try:
            raw = path.read_bytes()
        except FileNotFoundError:
            return {}
        except OSError as exc:
            raise ConfigError(f"cannot read the model library index {path}: {exc.strerror}") from exc
        try:
            return msgspec.json.decode(raw, type=dict[str, LibraryEntry])
        except (msgspec.DecodeError, msgspec.ValidationError):
            return {}  # a damaged index is rebuilt by the next scan; no file is lost

    def _write(self, entries: dict[str, LibraryEntry]) -> None:
        write_private(self.root / INDEX_FILE, msgspec.json.encode(entries))

    def entries(self) -> list[LibraryEntry]:
        """Every entry whose file is still there as indexed (others are dropped from the index)."""
        with self._locked() as entries:
            for key, entry in list(entries.items()):
                if not _unchanged(entry):
                    del entries[key]
            return sorted(entries.values(), key=lambda e: (e.name, e.key))

    def check(self, deep: bool = False) -> tuple[int, list[tuple[LibraryEntry, str]]]:
        """How many entries the index holds, and those whose file is not as indexed, with why (read-only).

        A file that vanished, changed size or time, or is not a GGUF is a problem; ``deep`` also hashes
        each whole model and compares it with its id (stage files are checked by their manifest).
        """
        indexed = list(self._read().values())  # written atomically: no lock needed to read it
        problems = []
        for entry in sorted(indexed, key=lambda e: (e.name, e.key)):
            if not entry.file.exists():
                problems.append((entry, f"{entry.path} is gone"))
            elif not _unchanged(entry):
                problems.append((entry, f"{entry.path} changed since it was indexed"))
            elif not _is_gguf(entry.file):
                problems.append((entry, f"{entry.path} is not a GGUF file"))
            elif deep and entry.layers is None and file_sha256(entry.file) != entry.id:
                problems.append((entry, f"{entry.path} does not hash to its id {entry.short}"))
        return len(indexed), problems

    def scan(self) -> list[LibraryEntry]:
        """Index the GGUFs of the configured folders and the library's own files (hashing new ones).

        The library's own stage files carry their model id and range in their metadata, so a lost
        index loses nothing.
        """
        known = {e.path: e for e in self.entries()}
        found = []
        own = [p for p in self.root.glob("*.gguf") if MODEL_ID.match(p.stem)]
        for path in [*own, *(p for folder in self.folders if folder.is_dir() for p in sorted(folder.glob("*.gguf")))]:
            entry = known.get(str(path.resolve()))
            if entry is None and _is_gguf(path):
                owned = path.parent == self.root
                entry = self.add(path, source="library" if owned else "folder", owned=owned)
            if entry is not None:
                found.append(entry)
        for path in sorted((self.root / "stages").glob("*.gguf")):
            entry = known.get(str(path.resolve()))
            if entry is None:
                with contextlib.suppress(NotGGUF):
                    stage = stage_range(GGUFFile(path))
                    if stage is not None:
                        model, name, start, end = stage
                        entry = self.add(path, source="library", owned=True, name=name or model[:SHORT_HASH],
                                         model_id=model, layers=(start, end))
            if entry is not None:
                found.append(entry)
        return found

    def add(self, path: Path, *, source: str, owned: bool, name: str | None = None, model_id: str | None = None,
            layers: tuple[int, int] | None = None) -> LibraryEntry:
        """Index ``path`` (hashing it unless ``model_id`` is given: a stage file, or a file verified on arrival)."""
        path = path.resolve()
        digest = model_id or file_sha256(path, self.hash_cache)
        st = path.stat()
        entry = LibraryEntry(id=digest, name=name or model_id_for(path), path=str(path), size=st.st_size,
                             kind="stage" if layers else "whole", layers=layers, source=source, owned=owned,
                             mtime_ns=st.st_mtime_ns, last_used=time.time())
        with self._locked() as entries:
            old = entries.get(entry.key)
            if old is not None and _unchanged(old) and (old.path == entry.path or not owned):
                old.last_used = entry.last_used
                return old  # already indexed (as the library's own file, or from elsewhere): keep its origin
            entries[entry.key] = entry
        return entry

    def commit(self, tmp: Path, *, model_id: str, name: str, source: str,
               layers: tuple[int, int] | None = None) -> LibraryEntry:
        """Move a verified file written under :meth:`incoming` into the library and index it."""
        final = self.path_for(model_id, layers)
        final.parent.mkdir(parents=True, exist_ok=True)
        os.replace(tmp, final)
        return self.add(final, source=source, owned=True, name=name, model_id=model_id, layers=layers)

    def touch(self, entry: LibraryEntry) -> None:
        """Mark ``entry`` used now (eviction goes least recently used first)."""
        with self._locked() as entries:
            if entry.key in entries:
                entries[entry.key].last_used = time.time()

    # -- lookups --------------------------------------------------------------------------------

    def find(self, ref: str) -> LibraryEntry | None:
        """The whole model ``ref`` names: an id, an id prefix (>= 8 hex digits), a name, or ``name@prefix``.

        Raises :class:`AmbiguousModel` when a name or prefix matches several different models.
        """
        ref = ref.strip()
        name, _, prefix = ref.partition("@")
        wholes = [e for e in self.entries() if e.kind == "whole"]
        if not prefix and len(ref) >= MIN_PREFIX and _HEX.match(ref):
            matches = [e for e in wholes if e.id.startswith(ref)]
            if matches:
                return _one(ref, matches)
        matches = [e for e in wholes if e.name == name and e.id.startswith(prefix)]
        return _one(ref, matches) if matches else None

    def whole(self, model_id: str) -> LibraryEntry | None:
        """A whole file of the model ``model_id``, if the library has one."""
        return next((e for e in self.entries() if e.kind == "whole" and e.id == model_id), None)

    def stage(self, model_id: str, start: int, end: int) -> LibraryEntry | None:
        """A stage file of ``model_id`` holding layers ``[start, end)`` (its range may be wider)."""
        fits = [e for e in self.entries() if e.kind == "stage" and e.id == model_id and e.layers
                and e.layers[0] <= start and end <= e.layers[1]]
        return min(fits, key=lambda e: e.layers[1] - e.layers[0] if e.layers else 0, default=None)

    def available(self) -> list[LibraryEntry]:
        """Whole models on disk, one entry per id (what the peer record advertises)."""
        return list({e.id: e for e in self.entries() if e.kind == "whole"}.values())

    # -- removal and the budget -----------------------------------------------------------------

    def remove(self, ref: str) -> list[LibraryEntry]:
        """Forget every entry of the model ``ref`` names (an id or prefix, or a name); delete the files it owns."""
        target = self.find(ref)
        if target is None:
            ids = [e.id for e in self.entries() if e.kind == "stage" and e.id.startswith(ref.strip())]
            if not ids:
                return []
            model = ids[0]
        else:
            model = target.id
        removed = []
        with self._locked() as entries:
            for key, entry in list(entries.items()):
                if entry.id == model:
                    del entries[key]
                    removed.append(entry)
        for entry in removed:
            if entry.owned:
                entry.file.unlink(missing_ok=True)
        (self.root / "manifests" / f"{model}.msgpack").unlink(missing_ok=True)
        return removed

    def disk_bytes(self) -> int:
        """Bytes the library's own files occupy (what the budget counts)."""
        return sum(e.disk_bytes() for e in self.entries() if e.owned)

    def reserve(self, nbytes: int, keep: Iterable[str] = ()) -> list[LibraryEntry]:
        """Make room for ``nbytes`` more within the budget; returns what was evicted.

        Evicts the library's own files, least recently used first, stage files before whole ones, the
        weakly pinned (:attr:`kept`) last, sparing pinned entries and the keys in ``keep``.
        """
        if self.budget_bytes is None:
            return []
        spare = set(keep) | self.pinned
        used = self.disk_bytes()
        evicted: list[LibraryEntry] = []
        candidates = sorted((e for e in self.entries() if e.owned and e.key not in spare),
                            key=lambda e: (e.key in self.kept, e.kind != "stage", e.last_used))
        for entry in candidates:
            if used + nbytes <= self.budget_bytes:
                break
            used -= entry.disk_bytes()
            with self._locked() as entries:
                entries.pop(entry.key, None)
            entry.file.unlink(missing_ok=True)
            self.kept.discard(entry.key)
            evicted.append(entry)
        if used + nbytes > self.budget_bytes:
            raise DiskBudgetExceeded(
                f"{nbytes / 1e9:.2f} GB do not fit the model library's {self.budget_bytes / 1e9:.2f} GB budget "
                f"({used / 1e9:.2f} GB used by models in use or kept)")
        return evicted

    def pin(self, entry: LibraryEntry, *, weak: bool = False) -> None:
        """Keep ``entry`` from eviction while in use; ``weak``: kept for later, evicted only as a last resort."""
        (self.kept if weak else self.pinned).add(entry.key)

    def unpin(self, entry: LibraryEntry, *, weak: bool = False) -> None:
        (self.kept if weak else self.pinned).discard(entry.key)

    # -- manifests ------------------------------------------------------------------------------

    def manifest(self, entry: LibraryEntry) -> Manifest:
        """The manifest of a whole model (built once by hashing the file, then kept beside the index)."""
        path = self.root / "manifests" / f"{entry.id}.msgpack"
        with self._hashing:
            with contextlib.suppress(OSError, MeshllmError):
                cached = decode_manifest(path.read_bytes())
                if cached.model == entry.id and cached.size == entry.size:
                    return cached
            manifest = build_manifest(entry.file)
            if manifest.model != entry.id:
                raise NotGGUF(f"{entry.path} changed since it was indexed (sha256 {manifest.model[:12]}, "
                              f"not {entry.short})")
            path.parent.mkdir(parents=True, exist_ok=True)
            write_private(path, encode_manifest(manifest))
            return manifest


def _unchanged(entry: LibraryEntry) -> bool:
    try:
        st = entry.file.stat()
    except OSError:
        return False
    return st.st_size == entry.size and st.st_mtime_ns == entry.mtime_ns


def _is_gguf(path: Path) -> bool:
    try:
        with path.open("rb") as fh:
            return fh.read(4) == GGUF_MAGIC
    except OSError:
        return False


def _one(ref: str, matches: list[LibraryEntry]) -> LibraryEntry:
    ids = {e.id for e in matches}
    if len(ids) > 1:
        listing = ", ".join(sorted(f"{e.name}@{e.short}" for e in matches))
        raise AmbiguousModel(f"{ref!r} matches several models: {listing}")
    return max(matches, key=lambda e: e.last_used)
