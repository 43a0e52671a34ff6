"""The model library: lookups by id, prefix and name; folders indexed in place; the disk budget; removal."""

from __future__ import annotations

import hashlib
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from tinymodels import write_tiny_llama

from meshllm.models.library import AmbiguousModel, DiskBudgetExceeded, Library
from meshllm.models.refs import ModelNotFound, resolve_model


def owned_copy(lib: Library, src: Path, name: str, layers: tuple[int, int] | None = None, *,
               used: float = 0.0) -> str:
    """Put a copy of ``src`` into the library as if fetched; returns its id."""
    digest = hashlib.sha256(src.read_bytes()).hexdigest()
    tmp = lib.incoming(f"{name}.part")
    tmp.write_bytes(src.read_bytes())
    entry = lib.commit(tmp, model_id=digest, name=name, source="peer:x", layers=layers)
    with lib._locked() as entries:
        entries[entry.key].last_used = used
    return digest


def test_lookups_by_id_prefix_and_name(tmp_path: Path) -> None:
    folder = tmp_path / "mine"
    folder.mkdir()
    a = write_tiny_llama(folder / "alpha.gguf", seed=1)
    b = write_tiny_llama(folder / "beta.gguf", seed=2)
    (folder / "notes.gguf").write_bytes(b"not a model")
    lib = Library(tmp_path / "home" / "models", [folder])
    found = {e.name: e for e in lib.scan()}
    assert set(found) == {"alpha", "beta"} and not found["alpha"].owned
    alpha = found["alpha"]
    assert lib.find(alpha.id) == lib.find(alpha.id[:8]) == lib.find("alpha") == lib.find(f"alpha@{alpha.id[:6]}")
    assert lib.find(alpha.id[:7]) is None  # shorter than 8 hex digits: not an id prefix
    assert lib.find("gamma") is None and lib.find("alpha@ffffff") is None
    # the same name for two different files is ambiguous until the id says which
    other = tmp_path / "other"
    other.mkdir()
    write_tiny_llama(other / "alpha.gguf", seed=3)
    lib.folders.append(other)
    lib.scan()
    with pytest.raises(AmbiguousModel, match="several models"):
        lib.find("alpha")
    assert lib.find(f"alpha@{alpha.short}") == lib.find(alpha.id)
    # references resolve through the library; a path that does not exist is not looked up by name
    ref = resolve_model("beta", library=lib)
    assert ref.path == b.resolve() and ref.sha256 == found["beta"].id and ref.model_id == "beta"
    with pytest.raises(ModelNotFound, match="no model 'gamma'"):
        resolve_model("gamma", library=lib)
    with pytest.raises(ModelNotFound, match="does not exist"):
        resolve_model(str(tmp_path / "gamma.gguf"), library=lib)
    # a file that changed since it was indexed is dropped from the index (and re-hashed by the next scan)
    a.write_bytes(a.read_bytes() + b"\0")
    assert lib.whole(alpha.id) is None


def test_budget_evicts_stage_files_first_then_least_recently_used_never_pinned(tmp_path: Path) -> None:
    model = write_tiny_llama(tmp_path / "m.gguf", seed=4)
    size = model.stat().st_size
    lib = Library(tmp_path / "models", budget_bytes=int(size * 3.5))
    old = owned_copy(lib, write_tiny_llama(tmp_path / "old.gguf", seed=5), "old", used=1.0)
    new = owned_copy(lib, write_tiny_llama(tmp_path / "new.gguf", seed=6), "new", used=3.0)
    owned_copy(lib, model, "m", layers=(0, 1), used=5.0)
    assert lib.disk_bytes() >= 3 * size
    evicted = lib.reserve(size)
    assert [e.kind for e in evicted] == ["stage"]  # the stage file goes first, though it was used last
    lib.pin(lib.whole(old))  # in use
    evicted = lib.reserve(2 * size)
    assert [e.id for e in evicted] == [new] and lib.whole(old) is not None
    assert not Path(evicted[0].path).exists()
    with pytest.raises(DiskBudgetExceeded, match="budget"):
        lib.reserve(4 * size)
    assert lib.whole(old) is not None


def test_remove_deletes_only_what_the_library_made(tmp_path: Path) -> None:
    folder = tmp_path / "mine"
    folder.mkdir()
    mine = write_tiny_llama(folder / "keep.gguf", seed=7)
    lib = Library(tmp_path / "models", [folder])
    lib.scan()
    (gone,) = lib.remove("keep")
    assert not gone.owned and mine.exists() and lib.find("keep") is None
    digest = owned_copy(lib, write_tiny_llama(tmp_path / "f.gguf", seed=8), "fetched")
    owned_copy(lib, write_tiny_llama(tmp_path / "f.gguf", seed=8), "fetched", layers=(0, 1))
    removed = lib.remove(digest[:10])
    assert sorted(e.kind for e in removed) == ["stage", "whole"]
    assert all(not Path(e.path).exists() for e in removed) and not lib.entries()
    assert lib.remove("fetched") == []


def test_a_lost_index_is_rebuilt_from_the_files(tmp_path: Path) -> None:
    """Whole files are named by their id and stage files carry id, name and range: a scan finds them again."""
    from meshllm.models.manifest import build_manifest
    from meshllm.models.stage_file import stage_layout

    model = write_tiny_llama(tmp_path / "m.gguf", n_layers=4, seed=9)
    lib = Library(tmp_path / "models")
    digest = owned_copy(lib, model, "m")
    manifest = build_manifest(model)
    raw = model.read_bytes()
    layout = stage_layout(manifest, raw[: manifest.header.length], 1, 3, "m")
    part = lib.incoming("s.part")
    with part.open("wb") as fh:
        assert layout.header is not None
        fh.write(layout.header)
        for i, dest in layout.placements.items():
            fh.seek(dest)
            fh.write(raw[manifest.spans[i].offset : manifest.spans[i].end])
        fh.truncate(layout.size)
    lib.commit(part, model_id=digest, name="m", source="peer:x", layers=(1, 3))
    (tmp_path / "models" / "index.json").unlink()
    found = sorted((e.kind, e.name, e.layers) for e in Library(tmp_path / "models").scan())
    assert found == [("stage", "m", (1, 3)), ("whole", digest, None)]


def test_check_reports_files_not_as_indexed_without_touching_the_index(tmp_path: Path) -> None:
    lib = Library(tmp_path / "home" / "models")
    assert lib.check() == (0, [])
    src = write_tiny_llama(tmp_path / "src.gguf", seed=3)
    owned_copy(lib, src, "alpha")
    owned_copy(lib, write_tiny_llama(tmp_path / "b.gguf", seed=4), "beta")
    assert lib.check(deep=True) == (2, [])
    alpha, beta = sorted(lib.entries(), key=lambda e: e.name)
    index = (lib.root / "index.json").read_bytes()
    with alpha.file.open("r+b") as fh:  # same size and time, other bytes: only hashing finds it
        fh.seek(-1, 2)
        last = fh.read(1)
        fh.seek(-1, 2)
        fh.write(bytes([last[0] ^ 1]))
    os.utime(alpha.file, ns=(alpha.mtime_ns, alpha.mtime_ns))
    beta.file.unlink()
    count, problems = lib.check()
    assert count == 2 and [(e.name, why) for e, why in problems] == [("beta", f"{beta.path} is gone")]
    _, problems = lib.check(deep=True)
    assert {e.name for e, _ in problems} == {"alpha", "beta"}
    assert "does not hash to its id" in dict((e.name, why) for e, why in problems)["alpha"]
    assert (lib.root / "index.json").read_bytes() == index  # read-only


def test_peers_asking_for_one_manifest_at_once_get_the_same_one(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """The transfer server builds a manifest in a worker thread per request: concurrent requests
    must neither race on the file nor hash the model more than once."""
    from meshllm.models import library as library_module
    gguf = write_tiny_llama(tmp_path / "tiny.gguf", seed=4)
    lib = Library(tmp_path / "models")
    entry = lib.add(gguf, source="folder", owned=False)
    builds = []
    real = library_module.build_manifest
    monkeypatch.setattr(library_module, "build_manifest", lambda path: builds.append(path) or real(path))
    with ThreadPoolExecutor(max_workers=8) as pool:
        manifests = list(pool.map(lambda _: lib.manifest(entry), range(8)))
    assert len(builds) == 1
    assert all(m == manifests[0] for m in manifests) and manifests[0].model == entry.id
