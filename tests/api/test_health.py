"""``/health`` tells loading from ready: from the node's events, on a real server and on real nodes."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from api_server import serve
from nodes import NodeProcess, running_nodes
from tinymodels import write_tiny_llama

from meshllm.api.app import LocalBackend, Readiness, create_app
from meshllm.engine.llama import LlamaEngine
from meshllm.events import EventHub

pytestmark = pytest.mark.timeout(120)


def test_health_follows_the_node_events(tiny_engine: LlamaEngine) -> None:
    hub, readiness = EventHub(), Readiness()
    hub.add_sink(readiness.on_event)
    with serve(create_app(LocalBackend([tiny_engine]), readiness=readiness)) as url:
        def health() -> tuple[int, dict[str, object]]:
            answer = httpx.get(url + "/health")
            return answer.status_code, answer.json()

        assert health() == (503, {"status": "loading", "models": 1, "active_requests": 0, "ready_models": [],
                                  "loading": []})
        hub.publish("model_loading", model="tiny-llama")
        assert health()[1]["loading"] == ["tiny-llama"]
        hub.publish("model_ready", model="tiny-llama")
        hub.publish("split_placing", model="big")
        hub.publish("ready")
        code, body = health()
        assert code == 200 and body["status"] == "ok"
        assert body["ready_models"] == ["tiny-llama"] and body["loading"] == ["big"]
        hub.publish("split_ready", model="big")
        assert health()[1]["ready_models"] == ["big", "tiny-llama"]
        hub.publish("split_stage_failed", model="big")
        assert health()[1]["loading"] == ["big"], "a chain being re-placed is loading again"
        hub.publish("stopping")
        assert health() == (503, {"status": "stopping", "models": 1, "active_requests": 0,
                                  "ready_models": ["tiny-llama"], "loading": ["big"]})


@pytest.fixture(scope="module")
def gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_llama(tmp_path_factory.mktemp("models") / "tiny.gguf", seed=0)


@pytest.fixture(scope="module")
def nodes(tmp_path_factory: pytest.TempPathFactory, gguf: Path) -> Iterator[list[NodeProcess]]:
    """One node serving the tiny model whole; one asked to split it, with no worker to split it over."""
    base = tmp_path_factory.mktemp("health")
    with running_nodes() as started:
        started.append(NodeProcess(base / "whole", ["--model", str(gguf)], "whole"))
        started.append(NodeProcess(base / "split", ["--model", str(gguf), "--split", "force"], "split"))
        for node in started:
            node.wait_ready()
        yield started


def test_a_node_that_loaded_its_model_is_ready(nodes: list[NodeProcess]) -> None:
    answer = httpx.get(nodes[0].api + "/health")
    assert answer.status_code == 200
    assert answer.json() | {"active_requests": 0} == {"status": "ok", "models": 1, "active_requests": 0,
                                                       "ready_models": ["tiny"], "loading": []}


def test_a_split_still_waiting_for_workers_shows_as_loading(nodes: list[NodeProcess]) -> None:
    split = nodes[1]
    split.wait_event(lambda e: e["type"] == "split_waiting", 30.0)
    body = httpx.get(split.api + "/health").json()
    assert body["status"] == "ok" and body["loading"] == ["tiny"] and body["ready_models"] == []
