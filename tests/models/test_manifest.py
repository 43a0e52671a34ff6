"""Manifests (spans that tile the file, hashed per piece, signed) and stage files built from them."""

from __future__ import annotations

import hashlib
from pathlib import Path

import msgspec
import numpy as np
import pytest
from nacl.signing import SigningKey
from tinymodels import write_tiny_gemma3, write_tiny_llama

from meshllm.engine.ggml import StageModel
from meshllm.engine.llama_native import NativeModel
from meshllm.errors import BadSignature, DecodeError, WrongSigner
from meshllm.identity.ids import node_id
from meshllm.models.gguf_file import GGUFFile
from meshllm.models.manifest import BadManifest, build_manifest, open_manifest, sign_manifest
from meshllm.models.stage_file import KEY_SHAPE_ONLY, stage_layout, stage_range


def write_stage(model: Path, out: Path, start: int, end: int) -> Path:
    manifest = build_manifest(model, piece_size=1 << 16)
    raw = model.read_bytes()
    layout = stage_layout(manifest, raw[: manifest.header.length], start, end, "tiny")
    with out.open("wb") as fh:
        assert layout.header is not None
        fh.write(layout.header)
        for i, dest in layout.placements.items():
            fh.seek(dest)
            fh.write(raw[manifest.spans[i].offset : manifest.spans[i].end])
        fh.truncate(layout.size)
    return out


def test_spans_tile_the_file_and_pieces_hash_it(tmp_path: Path) -> None:
    model = write_tiny_llama(tmp_path / "m.gguf", n_layers=3, seed=1)
    raw = model.read_bytes()
    m = build_manifest(model, piece_size=1 << 16)
    assert m.model == hashlib.sha256(raw).hexdigest() and m.spans[0].offset == 0 and m.spans[-1].end == len(raw)
    for i in range(len(m.spans)):
        for piece in m.pieces(i):
            assert piece.check(raw[piece.offset : piece.offset + piece.length])
    layer_spans = m.spans_for([(t.offset, t.nbytes) for t in GGUFFile(model).tensors if t.name.startswith("blk.1.")])
    assert len(layer_spans) == 1  # one layer's tensors are one span
    with pytest.raises(BadManifest, match="starts at"):
        msgspec.structs.replace(m, spans=[m.spans[0], *m.spans[2:]]).validate()
    with pytest.raises(BadManifest, match="piece digests"):
        msgspec.structs.replace(m, spans=[msgspec.structs.replace(m.spans[0], pieces=[]), *m.spans[1:]]).validate()


def test_signed_manifests_name_their_signer_and_model(tmp_path: Path) -> None:
    model = write_tiny_llama(tmp_path / "m.gguf", seed=2)
    m = build_manifest(model)
    key = SigningKey.generate()
    me = node_id(bytes(key.verify_key))
    signed = sign_manifest(key, m)
    assert open_manifest(signed, me, m.model) == m
    with pytest.raises(WrongSigner):
        open_manifest(signed, node_id(bytes(SigningKey.generate().verify_key)))
    with pytest.raises(BadManifest, match="describes model"):
        open_manifest(signed, me, "0" * 64)
    tampered = bytearray(signed)
    tampered[-80] ^= 1
    with pytest.raises((BadSignature, DecodeError)):
        open_manifest(bytes(tampered), me)
    with pytest.raises(DecodeError):
        open_manifest(b"\x93garbage", me)


@pytest.mark.parametrize("bounds", [(0, 2), (2, 4), (4, 6), (0, 6)])
def test_a_stage_file_computes_what_the_whole_file_computes(tmp_path: Path, bounds: tuple[int, int]) -> None:
    model = write_tiny_gemma3(tmp_path / "g.gguf", n_layers=6) if bounds[0] % 4 == 0 else write_tiny_llama(
        tmp_path / "l.gguf", n_layers=6, seed=3)
    start, end = bounds
    stage = write_stage(model, tmp_path / "s.gguf", start, end)
    reader = GGUFFile(stage)
    assert stage_range(reader) == (build_manifest(model).model, "tiny", start, end)
    assert reader.fields[KEY_SHAPE_ONLY] == ([] if start == 0 or (end == 6 and "g.gguf" in str(model)) else
                                             ["token_embd.weight"])
    ours, whole = StageModel.load(stage, start, end, max_context=64), StageModel.load(model, start, end,
                                                                                     max_context=64)
    width = whole.hparams.width
    x = np.array([1, 7, 9]) if start == 0 else np.random.default_rng(0).standard_normal((3, width)).astype(np.float32)
    assert np.array_equal(ours.forward("s", x, 0), whole.forward("s", x, 0))
    ours.close()
    whole.close()
    NativeModel(stage, vocab_only=True).close()  # llama.cpp reads it too (a last stage's grammar vocabulary)
