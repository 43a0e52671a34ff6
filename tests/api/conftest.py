"""Fixtures for the API tests: a tiny llama model behind the real app on a real uvicorn server."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest
from api_server import serve
from tinymodels import write_tiny_llama

from meshllm.api.app import ApiLimits, LocalBackend, create_app
from meshllm.engine.llama import LlamaEngine


@pytest.fixture(scope="session")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 436 KB llama model with a byte vocabulary (one token per UTF-8 byte)."""
    return write_tiny_llama(tmp_path_factory.mktemp("models") / "tiny-llama.gguf", seed=0)


@pytest.fixture(scope="session")
def tiny_engine(tiny_gguf: Path) -> Iterator[LlamaEngine]:
    """A loaded engine; its worker thread outlives the loop that loaded it."""
    engine = LlamaEngine(tiny_gguf, n_ctx=512, n_threads=1)
    asyncio.run(engine.load())
    yield engine
    asyncio.run(engine.close())


@pytest.fixture(scope="session")
def tiny_server(tiny_engine: LlamaEngine) -> Iterator[str]:
    """Base URL of the app serving ``tiny_engine`` (default limits)."""
    app = create_app(LocalBackend([tiny_engine], node_id="node-a"), ApiLimits(max_body_bytes=256 * 1024))
    with serve(app) as url:
        yield url
