"""Publishing and finding a mesh through the CLI, on 127.0.0.1 (no mDNS: nodes on loopback never multicast).

Four nodes form a DHT: A (owns a mesh, serves a tiny model, DHT on from start) and three client
nodes of their own private meshes that bootstrap from A. A runs ``meshllm publish --name demo``;
a fresh node that knows only D1's DHT address runs ``meshllm discover`` and ``meshllm join <id>``,
then a chat request through it is answered by A. Listings live 6 s here (the hidden
``--listing-ttl``), so ``publish --off`` is seen leaving ``discover`` quickly.
"""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import pytest
from nodes import NodeProcess, meshllm, meshllm_json, running_nodes, wait_until
from tinymodels import write_tiny_llama

pytestmark = [pytest.mark.discovery, pytest.mark.timeout(180)]
TTL = "6"
NO_LOCAL_NODE = "http://127.0.0.1:9"
"""--api for `discover`: nothing listens there, so only the given bootstrap is used."""


def discover(bootstrap: str, *extra: str) -> list[dict[str, object]]:
    return meshllm_json("discover", "--no-mdns", "--dht-bootstrap", bootstrap, "--timeout", "4",
                        "--api", NO_LOCAL_NODE, *extra)


def test_publish_discover_join_and_chat(tmp_path: Path) -> None:
    pytest.importorskip("libp2p")
    model = write_tiny_llama(tmp_path / "tiny.gguf")
    with running_nodes() as nodes:
        a = NodeProcess(tmp_path / "a", ["--model", str(model), "--dht-port", "0", "--listing-ttl", TTL], "a")
        nodes.append(a)
        a.wait_ready()
        dht_a = a.dht_addr()
        peers = [NodeProcess(tmp_path / f"d{i}", ["--client", "--dht-bootstrap", dht_a], f"d{i}") for i in (1, 2, 3)]
        nodes.extend(peers)
        for peer in peers:
            peer.wait_ready()
        bootstrap = peers[0].dht_addr()
        mesh_id = a.ready["mesh_id"]

        start = time.monotonic()
        published = meshllm_json("publish", "--name", "demo", *a.api_args)
        assert published["published"] and published["mesh_id"] == mesh_id and published["dht"]
        found: list[dict[str, object]] = []

        def visible() -> bool:
            found[:] = [m for m in discover(bootstrap) if m["mesh_id"] == mesh_id]
            return bool(found)

        wait_until(visible, 30.0, interval=0.2)
        print(f"publish -> visible through D1's DHT in {time.monotonic() - start:.2f} s")
        listing = found[0]
        served = httpx.get(a.api + "/v1/models", timeout=5).json()["data"][0]["id"]
        assert listing["name"] == "demo" and listing["via"] == "dht" and listing["nodes"] == 1
        assert listing["models"] == [served]
        assert [m["mesh_id"] for m in discover(bootstrap, "--model", str(served))] == [mesh_id]
        assert discover(bootstrap, "--model", "no-such-model") == []
        table = meshllm("discover", "--no-mdns", "--dht-bootstrap", bootstrap, "--timeout", "4", "--api", NO_LOCAL_NODE)
        assert table.returncode == 0 and "demo" in table.stdout and mesh_id in table.stdout, table.stderr

        start = time.monotonic()
        e = NodeProcess(tmp_path / "e", [mesh_id, "--client", "--dht-bootstrap", bootstrap, "--timeout", "20"], "e",
                    command="join")
        nodes.append(e)
        ready = e.wait_ready(60.0)
        assert ready["mesh_id"] == mesh_id
        assert e.wait_event(lambda ev: ev["type"] == "mesh_found", 1)["via"] == "dht"
        wait_until(lambda: any(p["node_id"] == a.node_id and p["state"] == "alive" for p in e.status()["peers"]), 15)
        print(f"join by mesh id -> member seeing A in {time.monotonic() - start:.2f} s")

        not_owner = meshllm("publish", *e.api_args)
        assert not_owner.returncode == 1 and "only the node holding the mesh key" in not_owner.stderr

        models = httpx.get(e.api + "/v1/models", timeout=5).json()["data"]
        assert served in [m["id"] for m in models], models
        reply = httpx.post(e.api + "/v1/chat/completions", timeout=60, json={
            "model": served, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
        assert reply.status_code == 200, reply.text
        assert reply.json()["choices"][0]["message"]["content"] is not None

        off = meshllm_json("publish", "--off", *a.api_args)
        assert off["published"] is False
        gone = wait_until(lambda: all(m["mesh_id"] != mesh_id for m in discover(bootstrap)), float(TTL) + 15, 0.2)
        print(f"unpublished mesh left discover in {gone:.2f} s (listing TTL {TTL} s)")


def test_join_unknown_mesh_fails_in_one_line(tmp_path: Path) -> None:
    pytest.importorskip("libp2p")
    with running_nodes() as nodes:
        a = NodeProcess(tmp_path / "a", ["--client", "--dht-port", "0"], "a")
        nodes.append(a)
        a.wait_ready()
        start = time.monotonic()
        done = meshllm("join", "mesh-" + "a" * 26, "--home", str(tmp_path / "x"), "--mesh-host", "127.0.0.1",
                       "--port", "0", "--mesh-port", "0", "--dht-bootstrap", a.dht_addr(), "--timeout", "3")
        took = time.monotonic() - start
        assert done.returncode == 1
        lines = [line for line in done.stderr.splitlines() if line.strip()]
        assert lines[0].startswith("error: no live listing of mesh-aaaa") and "DHT" in lines[0], done.stderr
        assert took < 15, took

        owner_only = meshllm("publish", *a.api_args)  # A owns its mesh: fine
        assert owner_only.returncode == 0, owner_only.stderr
        nothing = meshllm("discover", "--no-mdns", "--timeout", "2", "--api", NO_LOCAL_NODE,
                          "--home", str(tmp_path / "x"))
        assert nothing.returncode == 0 and "no published mesh found" in nothing.stdout
        assert "DHT not searched" in nothing.stderr


def test_serve_auto_joins_the_best_mesh_with_no_bootstrap_on_the_command_line(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two published meshes on a local DHT; ``serve --auto --client --model tiny`` is given no
    --dht-bootstrap: it takes the DHT from $MESHLLM_DHT_BOOTSTRAP (as a user's default list would be
    overridden), picks the mesh that serves ``tiny`` over the empty one, joins and chats through it."""
    pytest.importorskip("libp2p")
    model = write_tiny_llama(tmp_path / "tiny.gguf")
    with running_nodes() as nodes:
        a = NodeProcess(tmp_path / "a", ["--model", str(model), "--dht-port", "0", "--listing-ttl", "30"], "a")
        nodes.append(a)
        a.wait_ready()
        dht_a = a.dht_addr()
        empty = NodeProcess(tmp_path / "b", ["--client", "--dht-bootstrap", dht_a, "--listing-ttl", "30"], "b")
        nodes.append(empty)
        empty.wait_ready()
        assert meshllm_json("publish", "--name", "served", *a.api_args)["published"]
        assert meshllm_json("publish", "--name", "empty", *empty.api_args)["published"]
        wait_until(lambda: len(discover(dht_a)) == 2, 30.0, interval=0.2)

        monkeypatch.setenv("MESHLLM_DHT_BOOTSTRAP", dht_a)
        c = NodeProcess(tmp_path / "c", ["--auto", "--client", "--model", "tiny"], "c")
        nodes.append(c)
        ready = c.wait_ready(60.0)
        assert ready["mesh_id"] == a.ready["mesh_id"]
        found = c.wait_event(lambda ev: ev["type"] == "mesh_found", 1)
        assert found["auto"] and found["dht_bootstrap_from"] == "$MESHLLM_DHT_BOOTSTRAP"
        wait_until(lambda: any(m["id"] == "tiny" for m in httpx.get(c.api + "/v1/models", timeout=5).json()["data"]),
                   15)
        reply = httpx.post(c.api + "/v1/chat/completions", timeout=60, json={
            "model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
        assert reply.status_code == 200, reply.text


def test_auto_with_nothing_published_fails_in_one_line(tmp_path: Path) -> None:
    out = meshllm("serve", "--auto", "--client", "--home", str(tmp_path / "x"), "--port", "0", "--mesh-port", "0",
                  "--mesh-host", "127.0.0.1")
    assert out.returncode != 0 and "no published mesh found" in out.stderr and "Traceback" not in out.stderr
    both = meshllm("join", "--auto", "mesh-abc", "--home", str(tmp_path / "y"))
    assert both.returncode != 0 and "--auto finds a mesh itself" in both.stderr
