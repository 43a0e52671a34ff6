"""An ``hf:`` model split over real nodes, each stage fetched straight from a local stand-in for the hub.

The coordinator is started with ``--model hf:...`` ``--split force --stages 3`` and two ``--worker``s
join; nobody has the file. The hub redirects to a CDN path, answers one range request with a 500
(retried) and damages its first answer of the header to a worker (cross-checked with the
coordinator's digest: refetched, the hub named). The chain serves the solo node's greedy text; each
worker downloaded exactly its share (the header and its layers' tensors), the coordinator less than
the whole file, and the bytes the nodes report add up to what the hub sent. The model is listed in
``/v1/models`` only once the chain serves.
"""

from __future__ import annotations

import hashlib
import itertools
from pathlib import Path

import httpx
import pytest
from hub_server import hub_server
from nodes import NodeProcess, running_nodes, wait_until
from tinymodels import write_tiny_llama

from meshllm.models.gguf_file import GGUFFile
from meshllm.models.hub_stage import skeleton
from meshllm.models.manifest import span_bounds
from meshllm.models.stage_file import stage_layout

pytestmark = [pytest.mark.timeout(180), pytest.mark.slow]

REPO = "tiny-org/tiny-GGUF"
MODEL = "tiny"
PROMPT = "Hello, world"


def complete(node: NodeProcess, attempts: int = 4) -> str:
    """Greedy text from ``node``. A chain on this shared 2-core host can miss a stage deadline (the first
    request builds every stage's graphs) and replan: then wait for it and ask again."""
    for _ in range(attempts):
        reply = httpx.post(node.api + "/v1/completions", timeout=60,
                           json={"model": MODEL, "prompt": PROMPT, "max_tokens": 16, "temperature": 0})
        if reply.status_code != 503:
            break
        wait_until(lambda: all(s["state"] == "ready" for s in node.status()["splits"]), 60.0, interval=0.2)
    assert reply.status_code == 200, reply.text
    return reply.json()["choices"][0]["text"]


def listed(node: NodeProcess) -> list[str]:
    return [m["id"] for m in httpx.get(node.api + "/v1/models", timeout=10).json()["data"]]


def fetched(node: NodeProcess) -> dict[str, int]:
    """Bytes the node reports taking from the hub, by transfer kind."""
    out: dict[str, int] = {}
    for t in node.status()["transfers"]:
        if t["kind"].startswith("hub-") and t["state"] == "done":
            out[t["kind"]] = out.get(t["kind"], 0) + t["fetched"]
    return out


def test_each_stage_fetches_only_its_share_from_the_hub(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    gguf = write_tiny_llama(tmp_path / f"{MODEL}.gguf", n_layers=6, seed=3)
    data = gguf.read_bytes()
    model_id = hashlib.sha256(data).hexdigest()
    reader = GGUFFile(gguf)
    header = data[:span_bounds(reader)[1]]
    with hub_server() as hub, running_nodes() as nodes:
        hub.add(REPO, f"{MODEL}.gguf", data)
        hub.redirect = True
        hub.fail_gets = {4}  # one of the coordinator's range requests gets a 500: retried
        hub.corrupt_nth(8, 2)  # the coordinator's header probe, then the first worker's header: damaged
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        monkeypatch.setenv("HF_HUB_DISABLE_TELEMETRY", "1")
        monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
        solo = NodeProcess(tmp_path / "solo", ["--engine", "ggml", "--model", str(gguf)], "solo")
        coord = NodeProcess(tmp_path / "c", ["--model", f"hf:{REPO}/{MODEL}.gguf", "--split", "force",
                                             "--stages", "3"], "coord")
        nodes += [solo, coord]
        token = coord.wait_ready()["invite"]
        # no worker yet, so no chain: the model is not listed, and a request for it says why it waits
        assert MODEL not in listed(coord)
        waiting = httpx.post(coord.api + "/v1/completions", timeout=30, json={"model": MODEL, "prompt": PROMPT})
        assert waiting.status_code == 503 and "worker" in waiting.text, waiting.text
        workers = [NodeProcess(tmp_path / f"w{i}", ["--worker", "--join", token], f"w{i}") for i in (1, 2)]
        nodes += workers
        ready = coord.wait_event(lambda e: e["type"] == "split_ready" and len(e["stages"]) == 3, 90.0)
        ranges = [s[1:] for s in ready["stages"]]
        bounds = [r[0] for r in ranges] + [ranges[-1][1]]
        assert bounds[0] == 0 and bounds[-1] == 6 and all(a < b for a, b in itertools.pairwise(bounds))
        # bytes per node, counted before any request (a replan on a loaded host may move layers): each
        # worker its header and layers (the damaged header twice), the coordinator less than the file
        manifest = skeleton(model_id, len(data), header)
        by_name = {w.wait_ready()["name"]: w for w in workers}
        stage_events = {e["node"]: e for e in coord.events if e["type"] == "split_stage_fetched"}
        (split,) = coord.status()["splits"]
        fetches = {s["node_id"]: s["fetch"] for s in split["stages"]}
        report = {"coord": sum(fetched(coord).values())}
        refetched = []
        for name, start, end in ready["stages"][1:]:
            worker = by_name[name]
            share = len(header) + stage_layout(manifest, header, start, end).fetch_bytes
            got = fetched(worker)["hub-stage"]
            event = stage_events[worker.node_id]
            assert event["bytes"] == got == fetches[worker.node_id]["bytes_done"]
            if event["bad_holders"]:
                assert event["bad_holders"] == [f"hub {hub.url.removeprefix('http://')}"]
                assert got == share + len(header)
                refetched.append(name)
                worker.wait_event(lambda e: e["type"] == "hub_piece_disagreed" and e["offset"] == 0, 5.0)
            else:
                assert got == share
            report[name] = got
            stored = list((worker.home / "models").glob("**/*.gguf"))
            assert [p.parent.name for p in stored] == ["stages"], stored
        assert len(refetched) == 1
        assert report["coord"] < len(data)
        assert sum(report.values()) == hub.bytes_sent
        assert not list((coord.home / "models").glob("*.gguf")), "the coordinator stored a whole model"
        partial = coord.home / "models" / "hub" / f"{model_id}.gguf"
        assert partial.stat().st_size == len(data) and partial.stat().st_blocks * 512 < len(data)
        print(f"file {len(data)} B; fetched from the hub per node: {report}; hub sent {hub.bytes_sent} B")
        solo.wait_ready()
        assert MODEL in listed(coord)
        assert complete(coord) == complete(solo)
