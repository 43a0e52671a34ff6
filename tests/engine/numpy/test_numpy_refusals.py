"""Models the runtime cannot run are refused with a clear error before any weight is dequantized."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from tinymodels import write_tiny_gguf, write_tiny_llama

from meshllm.engine.numpy import weights
from meshllm.engine.numpy.errors import UnsupportedModel
from meshllm.engine.numpy.memory import estimate_memory
from meshllm.engine.numpy.stage import StageModel
from meshllm.errors import MeshllmError


@pytest.fixture(autouse=True)
def no_dequantize(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fail the test if anything is dequantized."""

    def forbidden(*args: object) -> np.ndarray:
        raise AssertionError("a weight was dequantized before the model was refused")

    monkeypatch.setattr(weights, "gguf_dequantize", forbidden)


def _layer(prefix: str = "blk.0.") -> dict[str, np.ndarray]:
    f = np.zeros((64, 64), np.float32)
    names = ["attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down"]
    out = {f"{prefix}{n}.weight": f for n in names}
    out.update(
        {f"{prefix}attn_norm.weight": np.ones(64, np.float32), f"{prefix}ffn_norm.weight": np.ones(64, np.float32)}
    )
    return out


def _globals() -> dict[str, np.ndarray]:
    return {
        "token_embd.weight": np.zeros((259, 64), np.float32),
        "output_norm.weight": np.ones(64, np.float32),
        "output.weight": np.zeros((259, 64), np.float32),
    }


def test_unknown_architecture_is_named(tmp_path: Path) -> None:
    path = write_tiny_gguf(tmp_path / "mamba.gguf", "mamba", _globals())
    with pytest.raises(UnsupportedModel, match="'mamba'") as info:
        StageModel.load(path)
    assert isinstance(info.value, MeshllmError) and info.value.hint
    with pytest.raises(UnsupportedModel, match="'mamba'"):
        estimate_memory(path, 0, 1, 128)


def test_unsupported_tensor_type_is_named(tmp_path: Path) -> None:
    tensors = {**_globals(), **_layer()}
    # Q8_1 (type 9): 40-byte blocks of 32 values; the gguf package cannot dequantize it
    tensors["blk.0.ffn_up.weight"] = np.zeros((64, 64 // 32 * 40), np.uint8)
    path = write_tiny_gguf(tmp_path / "q81.gguf", "llama", tensors, raw_types={"blk.0.ffn_up.weight": 9})
    with pytest.raises(UnsupportedModel, match=r"blk\.0\.ffn_up\.weight has type Q8_1"):
        StageModel.load(path)


def test_mixture_of_experts_tensors_are_refused(tmp_path: Path) -> None:
    tensors = {**_globals(), **_layer(), "blk.0.ffn_gate_exps.weight": np.zeros((4, 64, 64), np.float32)}
    path = write_tiny_gguf(tmp_path / "moe.gguf", "llama", tensors)
    with pytest.raises(UnsupportedModel, match="ffn_gate_exps"):
        StageModel.load(path)


def test_missing_tensor_is_named(tmp_path: Path) -> None:
    tensors = {**_globals(), **_layer()}
    del tensors["blk.0.attn_k.weight"]
    path = write_tiny_gguf(tmp_path / "missing.gguf", "llama", tensors)
    with pytest.raises(UnsupportedModel, match=r"blk\.0\.attn_k\.weight"):
        StageModel.load(path)


def test_unknown_rope_scaling_is_refused(tmp_path: Path) -> None:
    path = write_tiny_llama(tmp_path / "longrope.gguf", rope_scaling={"type": "longrope", "factor": 2.0})
    with pytest.raises(UnsupportedModel, match="longrope"):
        StageModel.load(path)


def test_layer_range_outside_the_model(tmp_path: Path) -> None:
    path = write_tiny_llama(tmp_path / "llama.gguf")
    with pytest.raises(UnsupportedModel, match=r"\[1, 3\)"):
        StageModel.load(path, 1, 3)


def test_not_a_gguf(tmp_path: Path) -> None:
    path = tmp_path / "junk.gguf"
    path.write_bytes(b"not a model at all")
    with pytest.raises(UnsupportedModel, match="not a GGUF"):
        StageModel.load(path)
