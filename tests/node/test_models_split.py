"""Split models travel: workers that have no file host their layers by fetching only their range.

Real nodes through the CLI. Only the coordinator (and, in the second test, two other hosts) has the
GGUF; the workers' homes and library folders are empty and they are given no path. The model is a
75 MB tiny llama (8 layers of 9.4 MB) so a range spans several 4 MiB pieces and a transfer lasts
long enough to be interrupted.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import httpx
import pytest
from nodes import NodeProcess, running_nodes, wait_until
from tinymodels import write_tiny_llama

from meshllm.engine.ggml.hparams import read_hparams
from meshllm.engine.ggml.weights import plan_stage
from meshllm.models.gguf_file import GGUFFile
from meshllm.models.manifest import build_manifest

pytestmark = [pytest.mark.timeout(240), pytest.mark.slow]

MODEL = "wide"
PROMPT = "Hello, world"


@pytest.fixture(scope="module")
def gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_llama(tmp_path_factory.mktemp("wide") / f"{MODEL}.gguf", n_layers=8, width=384, ffn=1536,
                            heads=4, kv_heads=2, seed=7)


def complete(node: NodeProcess, max_tokens: int = 16, attempts: int = 4) -> str:
    """Greedy text from ``node``. A chain on this shared 2-core host can miss a stage deadline (the first
    request builds every stage's graphs; a busy core stalls a step) and replan: then wait and ask again."""
    for _ in range(attempts):
        reply = httpx.post(node.api + "/v1/completions", timeout=60,
                           json={"model": MODEL, "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0})
        if reply.status_code != 503:
            break
        wait_until(lambda: all(s["state"] == "ready" for s in node.status()["splits"]), 60.0, interval=0.2)
    assert reply.status_code == 200, reply.text
    return reply.json()["choices"][0]["text"]


def stored_stage(worker: NodeProcess, layers: list[int]) -> Path:
    """The stage file of ``layers`` in a worker's library. Its home holds no whole model file, and no stage
    file but ranges it was asked to fetch (its stage, warm spares' ranges, a replanned chain's stage)."""
    models = worker.home / "models"
    assert not list(models.glob("*.gguf")), "a worker stored a whole model"
    stages = list((models / "stages").glob("*.gguf"))
    (stage,) = [f for f in stages if f.name.endswith(f".{layers[0]}-{layers[1]}.gguf")]
    for file in stages:  # a file is committed after its transfer started, so the event is there or coming
        held = [int(n) for n in file.name.rsplit(".", 2)[1].split("-")]
        worker.wait_event(lambda e, held=held: e["type"] == "transfer_started" and e["layers"] == held, 10.0)
    return stage


def check_holds_only_its_range(stage: Path, model: Path, layers: list[int]) -> None:
    """The stage file's directory is the range's tensors, and its bytes on disk are theirs (plus the header)."""
    original = GGUFFile(model)
    hp = read_hparams(original)
    wanted = plan_stage(original, hp, layers[0], layers[1]).tensors()
    mine = GGUFFile(stage)
    data = {t.name for t in mine.tensors} - {"token_embd.weight"} if layers[0] else {t.name for t in mine.tensors}
    assert data == {t.name for t in wanted} - ({"token_embd.weight"} if layers[0] else set())
    need = sum(t.nbytes for t in wanted)
    on_disk = stage.stat().st_blocks * 512
    header = mine.data_offset
    assert need <= on_disk <= need + header + 256 * 1024, (need, on_disk, header)
    assert on_disk < model.stat().st_size * (layers[1] - layers[0] + 1) / hp.n_layers


def test_three_stages_from_one_file_match_solo(gguf: Path, tmp_path: Path) -> None:
    with running_nodes() as nodes:
        solo = NodeProcess(tmp_path / "solo", ["--engine", "ggml", "--model", str(gguf)], "solo")
        coord = NodeProcess(tmp_path / "c", ["--model", str(gguf), "--split", "force", "--stages", "3"], "coord")
        nodes += [solo, coord]
        token = coord.wait_ready()["invite"]
        workers = [NodeProcess(tmp_path / f"w{i}", ["--worker", "--join", token], f"w{i}") for i in (1, 2)]
        nodes += workers
        ready = coord.wait_event(lambda e: e["type"] == "split_ready" and len(e["stages"]) == 3, 120.0)
        solo.wait_ready()
        assert complete(coord) == complete(solo)
        # Each worker fetched its range before the chain was ready. A stage that misses a deadline on a busy
        # host replans the chain, which may move ranges and fetch those too: they come after this event.
        first = coord.events[:coord.events.index(ready)]
        fetched = {(e["node"], *e["layers"]): e["bytes"] for e in first if e["type"] == "split_stage_fetched"}
        by_name = {s[0]: s[1:] for s in ready["stages"]}
        for worker in workers:
            worker.wait_ready()
            layers = by_name[worker.name]
            assert fetched.get((worker.node_id, *layers), 0) > 0, fetched
            check_holds_only_its_range(stored_stage(worker, layers), gguf, layers)
            # its stage's transfer (a warm spare's range may follow it)
            transfer = next(t for t in worker.status()["transfers"] if t["layers"] == layers)
            assert transfer["state"] == "done"
            assert transfer["bytes_done"] == transfer["bytes_total"] > 0
            assert [h["name"] for h in transfer["holders"]] == ["coord"]
            assert [h["channel"] for h in transfer["holders"]] == ["tcp"]  # the bulk channel, not QUIC
            assert any(e["type"] == "transfer_progress" for e in worker.events)
        every = [(e["node"], *e["layers"]) for e in coord.events if e["type"] == "split_stage_fetched"]
        assert len(every) == len(set(every)), f"a replan fetched a range a worker already held: {every}"


@pytest.fixture(scope="module")
def thick(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """3 layers of 38 MB (10 pieces each): whichever range the worker is given, it is many pieces."""
    return write_tiny_llama(tmp_path_factory.mktemp("thick") / f"{MODEL}.gguf", n_layers=3, width=768, ffn=3072,
                            heads=4, kv_heads=2, seed=7)


def test_a_killed_holder_and_a_corrupt_holder_do_not_stop_the_chain(thick: Path, tmp_path: Path) -> None:
    gguf = thick
    manifest = build_manifest(gguf)
    # upload caps (config.toml) make the worker's 62 MB fetch last seconds, so holders it learns of
    # from gossip after it began join it, and one of them can be killed while it sends
    caps = {"c": 12, "h1": 8, "h2": None}
    copies = []
    for name, cap in caps.items():
        home = tmp_path / (name if name == "c" else f"{name}-home")
        home.mkdir()
        lines = [f"model_upload_limit_mb_s = {cap}"] if cap else []
        if name != "c":  # two --client nodes keep a copy in a folder their config.toml lists
            folder = tmp_path / f"{name}-files"
            folder.mkdir()
            copies.append(shutil.copy(gguf, folder / f"{MODEL}.gguf"))
            lines.append(f'model_dirs = ["{folder}"]')
        (home / "config.toml").write_text("\n".join(lines) + "\n")
    with running_nodes() as nodes:
        solo = NodeProcess(tmp_path / "solo", ["--engine", "ggml", "--model", str(gguf)], "solo")
        coord = NodeProcess(tmp_path / "c", ["--model", str(gguf), "--split", "force", "--stages", "2"], "coord")
        nodes += [solo, coord]
        token = coord.wait_ready()["invite"]
        # clients serve nothing and are never stages, but offer their library's files to the mesh
        holders = [NodeProcess(tmp_path / f"{n}-home", ["--join", token, "--client", "--member"], n)
                   for n in ("h1", "h2")]
        nodes += holders
        for h in holders:
            h.wait_ready()
        wait_until(lambda: sum(any(m["id"] == manifest.model for m in p["available"])
                               for p in coord.status()["peers"]) == 2, 30.0)
        # h2's copy then rots: every piece of every layer has bytes flipped in place, size and mtime kept
        st = os.stat(copies[1])
        with open(copies[1], "r+b") as fh:
            for span in range(2, len(manifest.spans)):
                for piece in manifest.pieces(span):
                    fh.seek(piece.offset + 64)
                    fh.write(b"\xff" * 32)
        os.utime(copies[1], ns=(st.st_atime_ns, st.st_mtime_ns))
        worker = NodeProcess(tmp_path / "w", ["--worker", "--join", token], "w")
        nodes.append(worker)
        started = worker.wait_event(lambda e: e["type"] == "transfer_started", 60.0)
        worker.wait_ready()

        def h1_sends() -> bool:
            (view,) = [t for t in worker.status()["transfers"] if t["layers"] == started["layers"]]
            assert not view["bytes_total"] or view["bytes_total"] - view["bytes_done"] > 8 << 20, \
                "too little left to kill h1 mid-transfer"
            return any(h["node_id"] == holders[0].node_id and h["bytes"] for h in view["holders"])

        wait_until(h1_sends, 30.0, interval=0.02)  # h1 joined the transfer and sends ...
        holders[0].kill()  # ... and dies while the worker fetches from it
        done = worker.wait_event(lambda e: e["type"] in ("transfer_done", "transfer_failed")
                                 and e["layers"] == started["layers"], 120.0)  # (a warm spare's may end first)
        assert done["type"] == "transfer_done", done
        dropped = {e["holder"]: e for e in worker.events
                   if e["type"] == "transfer_holder_dropped" and e["layers"] == started["layers"]}
        assert dropped[holders[1].node_id]["bad_bytes"], dropped
        assert holders[0].node_id in dropped and not dropped[holders[0].node_id]["bad_bytes"]
        coord.wait_event(lambda e: e["type"] == "split_ready", 60.0)
        solo.wait_ready()
        assert complete(coord) == complete(solo)
        layers = next(s["layers"] for s in coord.status()["splits"][0]["stages"] if s["name"] == "w")
        check_holds_only_its_range(stored_stage(worker, layers), gguf, layers)
