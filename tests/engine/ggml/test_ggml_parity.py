"""The ggml runtime computes exactly what llama.cpp computes, on tiny models of every supported variant.

Both run the same kernels — the node's default ``exact`` (weights in their file layout) and
``fast`` (repacked where llama.cpp's CPU backend repacks them, its own default) — and f16 KV caches,
with attention by softmax (llama-cpp-python's default) or flash attention; the logits must be equal
bit for bit, for a prompt in one batch and for a short prompt then one token at a time.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from stage_helpers import PROMPT, llama_cpp_scores
from tinymodels import write_tiny_gemma3, write_tiny_llama

from meshllm.engine.ggml.stage import StageModel

MODELS: dict[str, Callable[[Path], Path]] = {
    "llama": lambda d: write_tiny_llama(d / "llama.gguf", n_layers=4),
    "llama-gqa-1kv": lambda d: write_tiny_llama(d / "mqa.gguf", heads=8, kv_heads=1, seed=3),
    "qwen2-biases": lambda d: write_tiny_llama(d / "qwen2.gguf", arch="qwen2", seed=1),
    "llama-rope-linear": lambda d: write_tiny_llama(d / "linear.gguf", rope_scaling={"type": "linear", "factor": 4.0}),
    "llama-rope-yarn": lambda d: write_tiny_llama(
        d / "yarn.gguf",
        context=64,
        rope_scaling={"type": "yarn", "factor": 4.0, "original_context_length": 16},
    ),
    "llama3-rope-freqs": lambda d: write_tiny_llama(d / "freqs.gguf", rope_freqs=True, seed=4),
    "llama-q4_0-repacked": lambda d: write_tiny_llama(d / "q4.gguf", weight_type=Q.Q4_0, seed=5),
    "llama-q8_0": lambda d: write_tiny_llama(d / "q8.gguf", weight_type=Q.Q8_0, seed=6),
    "gemma3": lambda d: write_tiny_gemma3(d / "gemma3.gguf"),
    "gemma3-softcap": lambda d: write_tiny_gemma3(d / "softcap.gguf", softcap=3.0, seed=2),
}


@pytest.mark.parametrize("kernels", ["exact", "fast"])
@pytest.mark.parametrize("flash_attn", [False, True], ids=["softmax", "flash"])
@pytest.mark.parametrize("name", MODELS)
def test_prefill_logits_are_llama_cpps(name: str, flash_attn: bool, kernels: str, tmp_path: Path) -> None:
    path = MODELS[name](tmp_path)
    ref = llama_cpp_scores(path, [PROMPT], kernels, flash_attn=flash_attn)
    stage = StageModel.load(path, max_context=256, threads=1, flash_attn=flash_attn, kernels=kernels)
    try:
        ours = stage.forward("s", np.array(PROMPT), 0)
    finally:
        stage.close()
    assert ours.shape == ref.shape
    assert np.array_equal(ours, ref), f"max difference {np.abs(ours - ref).max()}"


@pytest.mark.parametrize("kernels", ["exact", "fast"])
@pytest.mark.parametrize("flash_attn", [False, True], ids=["softmax", "flash"])
@pytest.mark.parametrize("name", ["llama", "qwen2-biases", "llama-q4_0-repacked", "gemma3"])
def test_decode_logits_are_llama_cpps(name: str, flash_attn: bool, kernels: str, tmp_path: Path) -> None:
    """A 12-token prefill, then one token at a time, on both engines: equal at every position."""
    path = MODELS[name](tmp_path)
    batches = [PROMPT[:12]] + [[t] for t in PROMPT[12:]]
    ref = llama_cpp_scores(path, batches, kernels, flash_attn=flash_attn)
    stage = StageModel.load(path, max_context=256, threads=1, flash_attn=flash_attn, kernels=kernels)
    try:
        ours, pos = [], 0
        for batch in batches:
            ours.append(stage.forward("s", np.array(batch), pos))
            pos += len(batch)
    finally:
        stage.close()
    assert np.array_equal(np.concatenate(ours), ref)


def test_f32_kv_cache_is_close_to_llama_cpps(tiny_llama: Path) -> None:
    """On request the cache is float32; against llama.cpp with an f32 cache the logits stay within 1e-5."""
    ref = llama_cpp_scores(tiny_llama, [PROMPT], type_k=0, type_v=0)
    stage = StageModel.load(tiny_llama, max_context=256, threads=1, kv_type="f32")
    try:
        ours = stage.forward("s", np.array(PROMPT), 0)
    finally:
        stage.close()
    assert np.allclose(ours, ref, rtol=0, atol=1e-5 * np.abs(ref).max())
