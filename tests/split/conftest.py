"""Fixtures of the split tests: a tiny llama GGUF with enough layers for three stages."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tinymodels import write_tiny_llama


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 6-layer tiny llama (split points at every layer)."""
    return write_tiny_llama(tmp_path_factory.mktemp("split") / "tiny.gguf", n_layers=6)
