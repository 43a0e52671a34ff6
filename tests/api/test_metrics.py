"""``GET /metrics`` of real nodes after real traffic, read back with ``prometheus_client``'s own parser.

Node A serves the tool model; node B (a ``--client``) routes to it over the mesh (``tool_mesh``).
The fixture is shared with other tests, so each check compares a scrape after the requests with
one before them: the differences must be exactly what was sent.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import pytest
from nodes import NodeProcess, running_nodes
from prometheus_client.parser import text_string_to_metric_families
from tinymodels import TOOL_MODEL

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def scrape(node: NodeProcess) -> Samples:
    response = httpx.get(node.api + "/metrics", headers=node.admin_headers, timeout=10)
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/plain")
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(response.text) for s in family.samples}


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples.get((name, frozenset(labels.items())), 0.0)


def family(samples: Samples, name: str) -> dict[frozenset[tuple[str, str]], float]:
    return {labels: v for (n, labels), v in samples.items() if n == name}


def chat(api: str, model: str = TOOL_MODEL, stream: bool = False) -> tuple[int, dict[str, int]]:
    """One chat completion; its status and usage (streamed: from the usage chunk)."""
    body = {"model": model, "messages": [{"role": "user", "content": "hello"}], "stream": stream}
    if not stream:
        response = httpx.post(api + "/v1/chat/completions", json=body, timeout=60)
        return response.status_code, response.json().get("usage", {})
    body["stream_options"] = {"include_usage": True}
    usage: dict[str, int] = {}
    with httpx.stream("POST", api + "/v1/chat/completions", json=body, timeout=60) as response:
        for line in response.iter_lines():
            if line.startswith("data: {") and (chunk := json.loads(line[6:])).get("usage"):
                usage = chunk["usage"]
        return response.status_code, usage


def test_metrics_count_local_and_routed_requests(tool_mesh: tuple[NodeProcess, NodeProcess]) -> None:
    a, b = tool_mesh
    before_a, before_b = scrape(a), scrape(b)
    answers_a = [chat(a.api), chat(a.api), chat(a.api, stream=True)]
    answers_b = [chat(b.api), chat(b.api, stream=True)]
    assert {status for status, _ in answers_a + answers_b} == {200}
    assert chat(b.api, model="no-such-model")[0] == 404
    after_a, after_b = scrape(a), scrape(b)

    def grew(after: Samples, before: Samples, name: str, **labels: str) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    local = {"model": TOOL_MODEL, "route": "local"}
    routed = {"model": TOOL_MODEL, "route": "routed"}
    assert grew(after_a, before_a, "meshllm_requests_total", **local) == 3
    assert grew(after_b, before_b, "meshllm_requests_total", **routed) == 2
    assert grew(after_b, before_b, "meshllm_request_errors_total", route="none") == 1
    for after, before, labels, answers in ((after_a, before_a, local, answers_a),
                                           (after_b, before_b, routed, answers_b)):
        for kind in ("prompt", "completion"):
            sent = sum(usage[f"{kind}_tokens"] for _, usage in answers)
            assert grew(after, before, "meshllm_tokens_total", kind=kind, **labels) == sent
        assert grew(after, before, "meshllm_time_to_first_token_seconds_count", **labels) == len(answers)
        assert grew(after, before, "meshllm_time_to_first_token_seconds_bucket", le="+Inf", **labels) == len(answers)
        completion = sum(usage["completion_tokens"] for _, usage in answers)
        assert grew(after, before, "meshllm_inter_token_seconds_count", **labels) <= completion - len(answers)
    assert grew(after_a, before_a, "meshllm_served_for_peers_total") == 2

    # state read at scrape time: slots, peers, RTT, stream bytes of the routed requests
    assert value(after_a, "meshllm_slots", model=TOOL_MODEL) >= 1
    assert value(after_a, "meshllm_slots_busy", model=TOOL_MODEL) == 0
    assert value(after_a, "meshllm_queue_depth", model=TOOL_MODEL) == 0
    assert value(after_b, "meshllm_peers", state="alive") >= 1
    rtts = family(after_b, "meshllm_peer_rtt_seconds")
    assert any(("peer", a.node_id) in labels and 0 < v < 1 for labels, v in rtts.items()), rtts
    for direction in ("sent", "received"):
        assert grew(after_b, before_b, "meshllm_stream_bytes_total", kind="request", direction=direction) > 0
        assert grew(after_a, before_a, "meshllm_stream_bytes_total", kind="request", direction=direction) > 0
    assert value(after_b, "meshllm_failovers_total") == 0 and value(after_b, "meshllm_replays_total") == 0


def test_metrics_need_the_admin_token(tool_mesh: tuple[NodeProcess, NodeProcess]) -> None:
    a, _ = tool_mesh
    assert httpx.get(a.api + "/metrics", timeout=10).status_code == 401
    wrong = httpx.get(a.api + "/metrics", headers={"Authorization": "Bearer " + "x" * 32}, timeout=10)
    assert wrong.status_code == 401 and "not valid" in wrong.json()["error"]["message"]


@pytest.fixture(scope="module")
def public_node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NodeProcess]:
    with running_nodes() as nodes:
        node = NodeProcess(tmp_path_factory.mktemp("public") / "home", ["--client", "--metrics-public"], "pub")
        nodes.append(node)
        node.wait_ready()
        yield node


def test_metrics_public_answers_anyone(public_node: NodeProcess) -> None:
    response = httpx.get(public_node.api + "/metrics", timeout=10)
    assert response.status_code == 200
    names = {f.name for f in text_string_to_metric_families(response.text)}
    assert {"meshllm_requests", "meshllm_peers", "meshllm_time_to_first_token_seconds"} <= names
    assert httpx.post(public_node.api + "/api/invite", json={}, timeout=10).status_code == 401  # only /metrics
