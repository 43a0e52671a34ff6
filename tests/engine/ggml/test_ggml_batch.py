"""StageModel.forward_batch: several sessions' rows in one graph, each row bit for bit what it is alone.

Under exact kernels a row's result must not depend on the rows beside it: that is what lets a split
chain batch its sessions without changing any text. Float matrices compute a lone row with another
kernel than a batch, so a stage serving batches pads lone rows (``batch_exact``); quantized ones do
not need it (the default model).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from tinymodels import write_tiny

from meshllm.engine.ggml import StageModel
from meshllm.engine.ggml.errors import StageInputError

PROMPTS = (5, 9, 3, 14)
STEPS = 6


def _inputs(stage: StageModel, rng: np.random.Generator, n: int) -> np.ndarray:
    if stage.first:
        return rng.integers(3, 250, n)
    return rng.standard_normal((n, stage.hparams.width)).astype(np.float32)


def _same(alone: list[list[np.ndarray]], batched: list[list[np.ndarray]]) -> bool:
    return all(np.array_equal(x, y) for a, b in zip(alone, batched, strict=True) for x, y in zip(a, b, strict=True))


def _alone_and_batched(stage: StageModel, seed: int = 0) -> tuple[list[list[np.ndarray]], list[list[np.ndarray]]]:
    """Every session's decode outputs computed alone, then with all sessions in one forward_batch per step."""
    rng = np.random.default_rng(seed)
    prompts = [_inputs(stage, rng, n) for n in PROMPTS]
    steps = [[_inputs(stage, rng, 1) for _ in range(STEPS)] for _ in prompts]
    alone: list[list[np.ndarray]] = []
    for i, prompt in enumerate(prompts):
        stage.forward(f"alone{i}", prompt, 0, last_only=True)
        alone.append([stage.forward(f"alone{i}", x, len(prompt) + j, last_only=True) for j, x in enumerate(steps[i])])
        stage.forward(f"batch{i}", prompt, 0, last_only=True)
    batched: list[list[np.ndarray]] = [[] for _ in prompts]
    for j in range(STEPS):
        live = [i for i in range(len(prompts)) if j < STEPS - i]  # sessions leave the batch one by one
        outs = stage.forward_batch([(f"batch{i}", steps[i][j], len(prompts[i]) + j) for i in live], last_only=True)
        for i, out in zip(live, outs, strict=True):
            batched[i].append(out)
    return [a[: len(b)] for a, b in zip(alone, batched, strict=True)], batched


@pytest.mark.parametrize(("start", "end"), [(0, 4), (0, 2), (2, 4)])
def test_batched_rows_are_the_rows_alone(tiny_llama: Path, start: int, end: int) -> None:
    stage = StageModel.load(tiny_llama, start, end, max_context=256, threads=1)
    try:
        assert stage.batch_exact() is True  # f32 matrices: a lone row gets a scratch row beside it
        alone, batched = _alone_and_batched(stage)
        for a, b in zip(alone, batched, strict=True):
            assert all(np.array_equal(x, y) for x, y in zip(a, b, strict=True))
            assert b[0].shape == ((1, stage.hparams.vocab) if stage.last else (1, stage.hparams.width))
        assert stage.session_length("batch0") == PROMPTS[0] + STEPS
    finally:
        stage.close()


def test_without_padding_a_lone_float_row_differs(tiny_llama: Path) -> None:
    """Why ``batch_exact`` pads: on f32 weights, a lone row is rounded differently from a batched one."""
    stage = StageModel.load(tiny_llama, max_context=256, threads=1)
    try:
        alone, batched = _alone_and_batched(stage)
        assert not _same(alone, batched)
    finally:
        stage.close()


def test_gemma3_sliding_windows_and_flash_attention_batch_exactly(tiny_gemma3: Path) -> None:
    for flash in (False, True):
        stage = StageModel.load(tiny_gemma3, max_context=256, threads=1, flash_attn=flash)
        try:
            stage.batch_exact()
            alone, batched = _alone_and_batched(stage, seed=1)
            assert _same(alone, batched)
        finally:
            stage.close()


def test_bad_batches_are_refused_and_change_nothing(tiny_llama: Path) -> None:
    stage = StageModel.load(tiny_llama, 2, 4, max_context=256, threads=1)
    try:
        x = np.zeros((1, stage.hparams.width), np.float32)
        stage.forward("a", np.zeros((3, stage.hparams.width), np.float32), 0)
        with pytest.raises(StageInputError, match="distinct"):
            stage.forward_batch([("a", x, 3), ("a", x, 4)])
        with pytest.raises(StageInputError, match="position 3"):
            stage.forward_batch([("a", x, 5), ("b", x, 0)])
        with pytest.raises(StageInputError, match="NaN"):
            stage.forward_batch([("a", x, 3), ("b", np.full_like(x, np.nan), 0)])
        with pytest.raises(StageInputError, match="at most 512 rows"):
            stage.forward_batch([("a", np.zeros((300, 64), np.float32), 3), ("b", np.zeros((300, 64), np.float32), 0)])
        assert stage.session_length("a") == 3 and stage.session_length("b") == 0
        stage.forward_batch([("a", x, 3), ("b", x, 0)])  # and the sessions go on from where they were
        assert (stage.session_length("a"), stage.session_length("b")) == (4, 1)
    finally:
        stage.close()


@pytest.mark.slow
def test_default_model_batches_exactly_without_padding(gemma_model: Path) -> None:
    """The default model's quantized matrices compute a lone row as in a batch: no padding, still exact."""
    for start, end in ((0, 9), (9, 18)):
        stage = StageModel.load(gemma_model, start, end, max_context=256, threads=1)
        try:
            assert stage.batch_exact() is False
            alone, batched = _alone_and_batched(stage)
            assert _same(alone, batched)
        finally:
            stage.close()


def test_a_batch_measured_slower_runs_as_lone_rows_with_the_same_results(tiny_llama: Path) -> None:
    """Where lone rows are measured cheaper (CallCosts), a batch runs row by row; nothing else changes."""
    stage = StageModel.load(tiny_llama, 2, 4, max_context=256, threads=1)
    try:
        rng = np.random.default_rng(3)
        x = rng.standard_normal((4, stage.hparams.width)).astype(np.float32)
        for s in ("a", "b", "c"):
            stage.forward(s, x[:3], 0)
        alone = [stage.forward(s, x[3:], 3) for s in ("a", "b")]
        stage.trim("a", 3)
        stage.trim("b", 3)
        stage._costs.observe(1, 0.001)
        stage._costs.observe(2, 1.0)  # as if two rows in one call took far longer than two calls of one
        assert stage._costs.split(2)
        split = stage.forward_batch([("a", x[3:], 3), ("b", x[3:], 3)])
        assert all(np.array_equal(p, q) for p, q in zip(alone, split, strict=True))
        assert (stage.session_length("a"), stage.session_length("b")) == (4, 4)
    finally:
        stage.close()


@pytest.mark.parametrize("weight_type", ["F32", "Q8_0"])
def test_mixture_of_experts_rows_are_the_rows_alone(weight_type: str, tmp_path: Path) -> None:
    """Tokens of different sessions routed to different experts in one ``mul_mat_id``: each row still alone."""
    path = write_tiny("qwen3moe", tmp_path / "moe.gguf", weight_type=weight_type)
    stage = StageModel.load(path, max_context=256, threads=1)
    try:
        stage.batch_exact()
        alone, batched = _alone_and_batched(stage)
        assert _same(alone, batched)
    finally:
        stage.close()


@pytest.mark.parametrize("family", ["deepseek2", "deepseek2-mla"])
def test_latent_attention_rows_are_the_rows_alone(family: str, tmp_path: Path) -> None:
    """DeepSeek's caches (V narrower than K, or no V at all) attended per session in one batch."""
    stage = StageModel.load(write_tiny(family, tmp_path / "ds.gguf"), max_context=256, threads=1)
    try:
        stage.batch_exact()
        alone, batched = _alone_and_batched(stage)
        assert _same(alone, batched)
    finally:
        stage.close()
