"""``meshllm doctor`` against real nodes: a healthy pair passes (exit 0); then, with the node key made
0644, a port held by another socket and the peer killed, it names each problem with a fix (exit 1)."""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator
from typing import Any

import pytest
from nodes import NodeProcess, meshllm, running_nodes, sees, wait_until
from tinymodels import TOOL_MODEL, write_tiny_tool_model


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[NodeProcess, NodeProcess]]:
    tmp = tmp_path_factory.mktemp("doctor")
    model = write_tiny_tool_model(tmp / f"{TOOL_MODEL}.gguf")
    with running_nodes() as nodes:
        a = NodeProcess(tmp / "a", ["--model", str(model), "--threads", "1"], "alpha")
        nodes.append(a)
        token = a.wait_ready()["invite"]
        b = NodeProcess(tmp / "b", ["--client", "--member", "--join", token], "beta")
        nodes.append(b)
        b.wait_ready()
        wait_until(lambda: sees(a, b.node_id, ("alive",)), 20.0)
        yield a, b


def doctor(node: NodeProcess, *extra: str) -> tuple[int, dict[str, Any], str]:
    done = meshllm("doctor", *node.api_args, "--json", *extra)
    assert "Traceback" not in done.stderr, done.stderr
    text = meshllm("doctor", *node.api_args, *extra)
    return done.returncode, json.loads(done.stdout), text.stdout


def by_name(report: dict[str, Any]) -> dict[str, dict[str, str]]:
    return {c["name"]: c for c in report["checks"]}


def test_healthy_node_passes(pair: tuple[NodeProcess, NodeProcess]) -> None:
    a, _ = pair
    code, report, text = doctor(a)
    checks = by_name(report)
    assert code == 0 and report["ok"], text
    assert not [c for c in report["checks"] if c["outcome"] == "fail"]
    for name in ("llama-cpp", "home", "node.key", "admin.token", "mesh.key", "config", "node", "api port",
                 "mesh port", "disk", "models", "udp", "clock"):
        assert checks[name]["outcome"] == "ok", (name, text)
    assert "GPU backend" in checks["llama-cpp"]["detail"]
    assert "1 of 1 peer(s) reachable" in checks["udp"]["detail"]
    assert "no problems found" in text


def test_broken_node_names_each_problem(pair: tuple[NodeProcess, NodeProcess]) -> None:
    a, b = pair
    key = a.home / "node.key"
    b.kill()
    wait_until(lambda: not sees(a, b.node_id, ("alive",)), 30.0)
    key.chmod(0o644)
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        try:
            code, report, text = doctor(a, "--port", str(port))
        finally:
            key.chmod(0o600)
    checks = by_name(report)
    assert code == 1 and not report["ok"]
    assert checks["node.key"]["outcome"] == "fail" and "mode 644" in checks["node.key"]["detail"]
    assert checks["node.key"]["fix"].startswith(f"chmod 600 {key}")
    assert checks["api port"]["outcome"] == "fail" and f"TCP port {port} is in use" in checks["api port"]["detail"]
    assert checks["peer beta"]["outcome"] == "fail" and "not answering over UDP" in checks["peer beta"]["detail"]
    failed = {c["name"] for c in report["checks"] if c["outcome"] == "fail"}
    assert failed == {"node.key", "api port", "peer beta", "udp"}, text
    for name in failed:
        assert checks[name]["fix"], name
    assert text.count("fix: ") == len(failed) and "4 problem(s) found" in text
