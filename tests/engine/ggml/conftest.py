"""Fixtures for the ggml stage runtime tests: tiny models and the default model as one stage."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from tinymodels import write_tiny_gemma3, write_tiny_llama

from meshllm.engine.ggml.stage import StageModel


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny llama of tests/tinymodels.py, but with 4 layers so there are several split points."""
    return write_tiny_llama(tmp_path_factory.mktemp("models") / "tiny-llama.gguf", n_layers=4)


@pytest.fixture(scope="session")
def tiny_gemma3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 7-layer Gemma 3 (six local layers, one global) with an 8-token sliding window."""
    return write_tiny_gemma3(tmp_path_factory.mktemp("models") / "tiny-gemma3.gguf")


@pytest.fixture(scope="module")
def gemma_stage(gemma_model: Path) -> Iterator[StageModel]:
    """The default model as one stage, one thread (loaded once per module: mapping is cheap, graphs are not)."""
    stage = StageModel.load(gemma_model, max_context=512, threads=1)
    yield stage
    stage.close()
