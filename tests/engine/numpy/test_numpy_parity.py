"""The numpy runtime computes what llama.cpp computes, on tiny models of every supported family.

llama.cpp runs with a float32 KV cache here so that the comparison measures our arithmetic, not
llama.cpp's default float16 cache (which alone costs about 5e-4 relative on these models).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from stage_helpers import F32_KV, PROMPT, llama_cpp_scores, max_relative_error
from tinymodels import write_tiny_gemma3, write_tiny_llama

from meshllm.engine.numpy.stage import StageModel

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
    "gemma3": lambda d: write_tiny_gemma3(d / "gemma3.gguf"),
    "gemma3-softcap": lambda d: write_tiny_gemma3(d / "softcap.gguf", softcap=3.0, seed=2),
}
# llama-style numerics match llama.cpp's to float32 rounding; Gemma's GELU is computed exactly here
# while ggml reads it from a float16 table, which costs a few 1e-4.
TOLERANCE = {"gemma3": 1e-3, "gemma3-softcap": 1e-3}


@pytest.mark.parametrize("name", MODELS)
def test_prefill_logits_match_llama_cpp(name: str, tmp_path: Path) -> None:
    path = MODELS[name](tmp_path)
    ref = llama_cpp_scores(path, PROMPT, **F32_KV)
    ours = StageModel.load(path).forward("s", np.array(PROMPT), 0)
    assert ours.shape == ref.shape
    assert max_relative_error(ours, ref) < TOLERANCE.get(name, 1e-5)


@pytest.mark.parametrize("name", ["llama", "gemma3"])
def test_decode_logits_match_llama_cpp(name: str, tmp_path: Path) -> None:
    """A 12-token prefill then one token at a time gives llama.cpp's logits at every position."""
    path = MODELS[name](tmp_path)
    ref = llama_cpp_scores(path, PROMPT, **F32_KV)
    stage = StageModel.load(path)
    steps = [stage.forward("s", np.array(PROMPT[:12]), 0)]
    steps += [stage.forward("s", np.array([t]), pos) for pos, t in enumerate(PROMPT[12:], start=12)]
    assert max_relative_error(np.concatenate(steps), ref) < TOLERANCE.get(name, 1e-5)


def test_default_f16_kv_cache_is_within_1e3(tiny_llama: Path) -> None:
    """Against llama.cpp's default settings (float16 KV cache) the FACTS.md tiny model is within 1e-3."""
    ref = llama_cpp_scores(tiny_llama, PROMPT)
    ours = StageModel.load(tiny_llama).forward("s", np.array(PROMPT), 0)
    assert max_relative_error(ours, ref) < 1e-3
