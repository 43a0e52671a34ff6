"""A mesh found and joined over mDNS alone: two network namespaces on one bridge, no DHT bootstrap.

Node A (namespace A) serves a tiny model and runs ``meshllm publish``; in namespace B,
``meshllm discover`` lists it (via the LAN) and ``meshllm join <mesh-id>`` finds it by mDNS,
verifies the listing fetched over QUIC, and joins with its open invite.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
from lan import two_host_lan
from nodes import NodeProcess, meshllm_json, running_nodes, wait_until
from tinymodels import write_tiny_llama

pytestmark = [pytest.mark.discovery, pytest.mark.netns, pytest.mark.timeout(120)]


def test_find_and_join_over_mdns_without_bootstrap(tmp_path: Path) -> None:
    model = write_tiny_llama(tmp_path / "tiny.gguf")
    with two_host_lan(f"dl{os.getpid() % 100000}", "10.232.0") as (ns_a, ip_a, ns_b, ip_b), running_nodes() as nodes:
        in_a, in_b = ("ip", "netns", "exec", ns_a), ("ip", "netns", "exec", ns_b)
        a = NodeProcess(tmp_path / "a", ["--model", str(model)], "a", prefix=in_a, mesh_host=ip_a)
        nodes.append(a)
        a.wait_ready()
        mesh_id = a.ready["mesh_id"]
        published = meshllm_json("publish", "--name", "lan-demo", *a.api_args, prefix=in_a)
        assert published["lan"], published

        start = time.monotonic()
        listed = meshllm_json("discover", "--interface", ip_b, "--timeout", "4", "--api", "http://127.0.0.1:9",
                              prefix=in_b)
        print(f"discover over mDNS took {time.monotonic() - start:.2f} s")
        assert [(m["mesh_id"], m["name"], m["via"]) for m in listed] == [(mesh_id, "lan-demo", "lan")]
        assert listed[0]["bootstrap"] == [a.mesh_addr] and a.mesh_addr.startswith(ip_a)

        start = time.monotonic()
        b = NodeProcess(tmp_path / "b", [mesh_id, "--client", "--timeout", "20"], "b", command="join", prefix=in_b,
                    mesh_host=ip_b)
        nodes.append(b)
        assert b.wait_ready(60.0)["mesh_id"] == mesh_id
        assert b.wait_event(lambda e: e["type"] == "mesh_found", 1)["via"] == "lan"

        def b_sees_a() -> bool:
            status = meshllm_json("status", *b.api_args, prefix=in_b, timeout=10)
            return any(p["node_id"] == a.node_id and p["state"] == "alive" for p in status["peers"])

        wait_until(b_sees_a, 15.0, interval=0.3)
        print(f"join by mesh id over mDNS -> member seeing A in {time.monotonic() - start:.2f} s")
