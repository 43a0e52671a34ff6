"""What the runtime cannot run is refused with a clear error before anything is mapped, never an abort.

An autouse fixture makes mapping a model file fail the test: every refusal here must come from the
header, the metadata or the ggml library check alone. (ggml aborts the process on a failed assert,
so a model that reached it with a bad shape or type would kill the test run, not fail one test.)
"""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np
import pytest
from tinymodels import write_tiny, write_tiny_gguf, write_tiny_llama

from meshllm.engine.ggml import lib, weights
from meshllm.engine.ggml.errors import UnsupportedModel
from meshllm.engine.ggml.families import REGISTRY
from meshllm.engine.ggml.memory import estimate_memory
from meshllm.engine.ggml.stage import StageModel
from meshllm.errors import MeshllmError
from meshllm.models.metadata import NotGGUF


@pytest.fixture(autouse=True)
def no_mapping(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fail the test if a model file is mapped."""

    class Forbidden:
        def __init__(self, *args: object) -> None:
            raise AssertionError("the model was mapped before it was refused")

    monkeypatch.setattr(weights, "_Map", Forbidden)


def _layer(prefix: str = "blk.0.") -> dict[str, np.ndarray]:
    f = np.zeros((64, 64), np.float32)
    names = ["attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down"]
    out = {f"{prefix}{n}.weight": f for n in names}
    out["blk.0.attn_k.weight"] = out["blk.0.attn_v.weight"] = np.zeros((32, 64), np.float32)  # 2 KV heads of 16
    out["blk.0.ffn_gate.weight"] = out["blk.0.ffn_up.weight"] = np.zeros((128, 64), np.float32)
    out["blk.0.ffn_down.weight"] = np.zeros((64, 128), np.float32)
    out[f"{prefix}attn_norm.weight"] = out[f"{prefix}ffn_norm.weight"] = np.ones(64, np.float32)
    return out


def _globals() -> dict[str, np.ndarray]:
    return {
        "token_embd.weight": np.zeros((259, 64), np.float32),
        "output_norm.weight": np.ones(64, np.float32),
        "output.weight": np.zeros((259, 64), np.float32),
    }


def _refused(path: Path, match: str) -> UnsupportedModel:
    with pytest.raises(UnsupportedModel, match=match) as info:
        StageModel.load(path)
    assert isinstance(info.value, MeshllmError) and info.value.hint
    with pytest.raises(UnsupportedModel, match=match):
        estimate_memory(path, 0, 1, 128)
    return info.value


def test_a_valid_tiny_model_passes_the_same_checks(tmp_path: Path) -> None:
    """The fixtures' hand-written model is right, so each refusal below is about its one defect."""
    path = write_tiny_gguf(tmp_path / "ok.gguf", "llama", {**_globals(), **_layer()})
    assert estimate_memory(path, 0, 1, 128) > 0


def test_unknown_architecture_is_named(tmp_path: Path) -> None:
    error = _refused(write_tiny_gguf(tmp_path / "mamba.gguf", "mamba", _globals()), "'mamba'")
    assert all(arch in str(error) for arch in REGISTRY), "the refusal lists every supported architecture"


def test_phi3_needs_fused_or_separate_qkv(tmp_path: Path) -> None:
    tensors = {**_globals(), **_layer()}
    tensors["blk.0.ffn_up.weight"] = np.zeros((256, 64), np.float32)  # Phi-3's fused gate and up
    del tensors["blk.0.ffn_gate.weight"]
    del tensors["blk.0.attn_v.weight"]
    _refused(write_tiny_gguf(tmp_path / "phi3.gguf", "phi3", tensors), "attn_qkv.weight or all of")


def test_moe_family_without_experts_is_refused(tmp_path: Path) -> None:
    _refused(write_tiny_gguf(tmp_path / "qwen3moe.gguf", "qwen3moe", {**_globals(), **_layer()}), "expert_count")


def test_unsupported_tensor_type_is_named(tmp_path: Path) -> None:
    tensors = {**_globals(), **_layer()}
    # Q8_1 (type 9): 40-byte blocks of 32 values; ggml has it only as a dot-product intermediate
    tensors["blk.0.ffn_up.weight"] = np.zeros((128, 64 // 32 * 40), np.uint8)
    path = write_tiny_gguf(tmp_path / "q81.gguf", "llama", tensors, raw_types={"blk.0.ffn_up.weight": 9})
    error = _refused(path, r"blk\.0\.ffn_up\.weight has type Q8_1")
    assert "supported here: " in str(error) and "Q4_K" in str(error) and "MXFP4" in str(error)


def test_unknown_tensor_type_id_is_named(tmp_path: Path) -> None:
    path = write_tiny_gguf(tmp_path / "q99.gguf", "llama", {**_globals(), **_layer()})
    data = bytearray(path.read_bytes())
    name = b"blk.0.ffn_up.weight"
    at = data.index(struct.pack("<Q", len(name)) + name) + 8 + len(name)
    ndim = struct.unpack_from("<I", data, at)[0]
    struct.pack_into("<I", data, at + 4 + 8 * ndim, 99)  # the tensor's type id
    path.write_bytes(bytes(data))
    _refused(path, r"blk\.0\.ffn_up\.weight has type unknown type id 99")


def test_wrong_tensor_shape_is_named(tmp_path: Path) -> None:
    tensors = {**_globals(), **_layer()}
    tensors["blk.0.ffn_down.weight"] = np.zeros((64, 96), np.float32)  # ffn is 128
    _refused(write_tiny_gguf(tmp_path / "shape.gguf", "llama", tensors), r"ffn_down\.weight has shape \[96, 64\]")


def test_mixture_of_experts_tensors_are_refused(tmp_path: Path) -> None:
    tensors = {**_globals(), **_layer(), "blk.0.ffn_gate_exps.weight": np.zeros((4, 64, 64), np.float32)}
    _refused(write_tiny_gguf(tmp_path / "moe.gguf", "llama", tensors), "ffn_gate_exps")


def test_missing_tensor_is_named(tmp_path: Path) -> None:
    tensors = {**_globals(), **_layer()}
    del tensors["blk.0.attn_k.weight"]
    _refused(write_tiny_gguf(tmp_path / "missing.gguf", "llama", tensors), r"blk\.0\.attn_k\.weight")


def test_unknown_rope_scaling_is_refused(tmp_path: Path) -> None:
    _refused(write_tiny_llama(tmp_path / "longrope.gguf", rope_scaling={"type": "longrope", "factor": 2.0}),
             "longrope")


def test_metadata_of_the_wrong_type_is_refused(tmp_path: Path) -> None:
    _refused(write_tiny_llama(tmp_path / "str.gguf", rope_scaling={"factor": "four"}), "rope.scaling.factor")


def test_layer_range_outside_the_model(tmp_path: Path) -> None:
    path = write_tiny_llama(tmp_path / "llama.gguf")
    with pytest.raises(UnsupportedModel, match=r"\[1, 3\)"):
        StageModel.load(path, 1, 3)


def test_not_a_gguf_and_a_truncated_one(tmp_path: Path) -> None:
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"not a model at all")
    with pytest.raises(NotGGUF, match="not a GGUF"):
        StageModel.load(junk)
    whole = write_tiny_llama(tmp_path / "whole.gguf").read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(whole[: len(whole) - 1000])
    with pytest.raises(NotGGUF, match="past the end of the file"):
        StageModel.load(cut)
    cut.write_bytes(whole[:100])
    with pytest.raises(NotGGUF, match="truncated"):
        StageModel.load(cut)


def test_unchecked_ggml_version_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = write_tiny_llama(tmp_path / "llama.gguf")
    monkeypatch.setattr(lib, "SUPPORTED_VERSIONS", ("9.9.9",))
    with pytest.raises(UnsupportedModel, match=r"ggml 0\.\d+\.\d+ .* is not a version this runtime was checked"):
        StageModel.load(path)


def test_tensor_struct_layout_mismatch_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = write_tiny_llama(tmp_path / "llama.gguf")
    monkeypatch.setattr(lib, "OBJECT_SIZE", 40)  # as if ggml_tensor had grown by 8 bytes
    with pytest.raises(UnsupportedModel, match="tensor struct"):
        StageModel.load(path)


def test_flash_attention_needs_an_f16_cache(tmp_path: Path) -> None:
    path = write_tiny_llama(tmp_path / "llama.gguf")
    with pytest.raises(UnsupportedModel, match="f16"):
        StageModel.load(path, flash_attn=True, kv_type="f32")
    with pytest.raises(UnsupportedModel, match="KV cache type"):
        StageModel.load(path, kv_type="q8")


@pytest.mark.parametrize(("extra", "match"), [
    ({"metadata": {"deepseek2.attention.key_length_mla": 24}}, "must be given together"),
    ({"metadata": {"deepseek2.expert_group_count": 2}}, "not a valid grouping"),
    ({"rope_scaling": {"type": "linear", "factor": 4.0}}, "linear rope scaling"),
], ids=["half-mla", "expert-groups", "linear-rope"])
def test_deepseek2_features_not_implemented_are_named(extra: dict[str, object], match: str, tmp_path: Path) -> None:
    _refused(write_tiny("deepseek2", tmp_path / "ds.gguf", **extra), match)  # type: ignore[arg-type]
