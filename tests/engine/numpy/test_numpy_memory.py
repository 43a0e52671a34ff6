"""estimate_memory predicts what a loaded stage actually holds."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from meshllm.engine.numpy.memory import estimate_memory
from meshllm.engine.numpy.stage import StageModel


def _kv_bytes(stage: StageModel, context: int) -> int:
    hp = stage.hparams
    return (stage.layer_end - stage.layer_start) * 2 * hp.n_kv_heads * hp.head_dim * 4 * context


@pytest.mark.parametrize(("start", "end"), [(0, 4), (0, 1), (1, 3), (3, 4)])
def test_estimate_is_weights_plus_kv(tiny_llama: Path, start: int, end: int) -> None:
    stage = StageModel.load(tiny_llama, start, end, max_context=300)
    assert estimate_memory(tiny_llama, start, end, 300) == stage.weights.nbytes + _kv_bytes(stage, 300)
    # a full cache holds exactly the estimated KV bytes
    inputs = np.arange(300) % 256 + 3 if stage.first else np.zeros((300, 64), np.float32)
    stage.forward("s", inputs, 0)
    assert stage._sessions["s"].nbytes == _kv_bytes(stage, 300)


def test_tied_head_counted_once(tiny_gemma3: Path) -> None:
    whole = StageModel.load(tiny_gemma3)
    assert estimate_memory(tiny_gemma3, 0, 7, 64) == whole.weights.nbytes + _kv_bytes(whole, 64)
    embed = 259 * 64 * 4
    halves = estimate_memory(tiny_gemma3, 0, 3, 64) + estimate_memory(tiny_gemma3, 3, 7, 64)
    assert halves == estimate_memory(tiny_gemma3, 0, 7, 64) + embed


def test_first_and_last_can_be_asked_for(tiny_llama: Path) -> None:
    middle = estimate_memory(tiny_llama, 1, 3, 16)
    assert estimate_memory(tiny_llama, 1, 3, 16, first=True) == middle + 259 * 64 * 4
    assert estimate_memory(tiny_llama, 1, 3, 16, last=True) == middle + (259 * 64 + 64) * 4


@pytest.mark.slow
def test_default_model_estimate(default_model: Path, default_stage: StageModel) -> None:
    assert estimate_memory(default_model, 0, 18, 1024) == default_stage.weights.nbytes + _kv_bytes(default_stage, 1024)
    # 268 M values as float32, plus 18 layers x 2 x 256 x 4 bytes per token
    assert estimate_memory(default_model, 0, 18, 0) == pytest.approx(1.07e9, rel=0.01)
