"""Whole models travel: ``serve --model NAME`` (or an id) on a node without the file fetches it from a peer.

Real nodes through the CLI: node a serves a tiny model from a path; node b joins naming the model by
name, c by its id prefix; neither has the file. Both fetch it from the mesh into their library
(a mesh downloads a model once, not once per machine), serve the same greedy text, and list it.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import httpx
import pytest
from nodes import NodeProcess, meshllm, running_nodes, wait_until
from tinymodels import write_tiny_llama

pytestmark = pytest.mark.timeout(180)
MODEL = "tiny"


def complete(node: NodeProcess) -> str:
    reply = httpx.post(node.api + "/v1/completions", timeout=60,
                       json={"model": MODEL, "prompt": "Hello", "max_tokens": 12, "temperature": 0})
    assert reply.status_code == 200, reply.text
    return reply.json()["choices"][0]["text"]


def test_serve_by_name_or_id_fetches_the_model_from_a_peer(tmp_path: Path) -> None:
    gguf = write_tiny_llama(tmp_path / f"{MODEL}.gguf", n_layers=2, seed=9)
    digest = hashlib.sha256(gguf.read_bytes()).hexdigest()
    with running_nodes() as nodes:
        a = NodeProcess(tmp_path / "a", ["--model", str(gguf)], "a")
        nodes.append(a)
        token = a.wait_ready()["invite"]
        # a hashes the file it serves into its library, then offers it to the mesh
        wait_until(lambda: bool(json.loads(meshllm("models", "list", "--api", a.api, "--home", str(a.home),
                                                   "--json").stdout)["files"]), 30.0, interval=0.5)
        b = NodeProcess(tmp_path / "b", ["--join", token, "--model", MODEL], "b")
        c = NodeProcess(tmp_path / "c", ["--join", token, "--model", digest[:12]], "c")
        nodes += [b, c]
        for node in (b, c):
            node.wait_ready(90.0)
            done = next(e for e in node.events if e["type"] == "transfer_done")
            assert done["kind"] == "whole" and done["bytes"] == gguf.stat().st_size
            stored = node.home / "models" / f"{digest}.gguf"
            assert stored.read_bytes() == gguf.read_bytes()
            assert complete(node) == complete(a)
        listing = json.loads(meshllm("models", "list", "--api", b.api, "--home", str(b.home), "--json").stdout)
        (mine,) = listing["files"]
        assert mine["id"] == digest and mine["name"] == MODEL and mine["source"].startswith("peer:")
        assert {o["node_id"] for o in listing["mesh"] if o["model_id"] == digest} >= {a.node_id}
        # the model is in use: the node refuses to delete it
        refused = meshllm("models", "rm", MODEL, "--api", b.api, "--home", str(b.home))
        assert refused.returncode == 1 and "in use" in refused.stderr, refused.stderr
        unknown = meshllm("models", "rm", "nothing-like-it", "--api", b.api, "--home", str(b.home))
        assert unknown.returncode == 1 and "no model" in unknown.stderr
