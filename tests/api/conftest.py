"""Fixtures for the API tests: tiny models behind the real app on a real uvicorn server, or in real nodes.

``tiny_*``: a random-weight llama (any text). ``tool_*``: the tool-calling model of
``tinymodels.write_tiny_tool_model`` (fixed replies and tool calls), served by real nodes: ``surface``
is the API a client test talks to, the serving node's own (``local``) or a ``--client`` node that
routes every request over the mesh (``routed``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from api_server import serve
from nodes import NodeProcess, running_nodes, wait_until
from tinymodels import TOOL_MODEL, write_tiny_llama, write_tiny_tool_model

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


@pytest.fixture(scope="session")
def tool_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tool-calling tiny model (2.4 MB, written in milliseconds)."""
    return write_tiny_tool_model(tmp_path_factory.mktemp("models") / f"{TOOL_MODEL}.gguf")


@pytest.fixture(scope="session")
def tool_mesh(tmp_path_factory: pytest.TempPathFactory, tool_gguf: Path) -> Iterator[tuple[NodeProcess, NodeProcess]]:
    """Node A serving the tool model and a ``--client`` node B joined to its mesh (real subprocesses)."""
    tmp = tmp_path_factory.mktemp("tool-mesh")
    with running_nodes() as nodes:
        a = NodeProcess(tmp / "a", ["--model", str(tool_gguf), "--threads", "1"], "a")
        nodes.append(a)
        token = a.wait_ready()["invite"]
        b = NodeProcess(tmp / "b", ["--client", "--join", token], "b")
        nodes.append(b)
        b.wait_ready()

        def routed() -> bool:
            data = httpx.get(f"{b.api}/v1/models", timeout=5).json()["data"]
            return any(m["id"] == TOOL_MODEL for m in data)

        wait_until(routed, 20.0)
        yield a, b


@pytest.fixture(params=["local", "routed"])
def surface(request: pytest.FixtureRequest, tool_mesh: tuple[NodeProcess, NodeProcess]) -> str:
    """Base URL (no ``/v1``) of the serving node (``local``) or of the client node that routes (``routed``)."""
    a, b = tool_mesh
    return a.api if request.param == "local" else b.api
