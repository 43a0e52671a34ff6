"""Model transfer benchmark: a stage's layers over ``model-fetch`` against one QUIC stream's bulk throughput.

Holders run in their own processes (aioquic is CPU-bound in Python: a sender and a receiver in one
process would share one core), each on its own endpoint on 127.0.0.1 with a copy of the model in its
library. The receiver is this process. Measured side by side, alternating, in one run:

- ``bulk``: one stream of raw 256 KiB frames from one holder (no files, no hashing): the ceiling one
  QUIC stream gives here;
- ``stage x1``: ``ModelStore.stage_file`` for a layer range from one holder (header, then pieces on
  ``WINDOW`` streams at a time, each sha256-checked and written to disk);
- ``stage x2``: the same range from two holders in parallel.

Ratios: ``stage x1 / bulk`` (goal >= 0.7) and ``stage x2 / stage x1`` (goal >= 1.5). On a 2-core host the
receiver and two holders compete for the cores, which caps the second ratio (see docs/benchmarks.md).

    .venv/bin/python bench/models.py [--runs 3] [--layers 1:7] [--out bench/results/models.json]
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import msgspec
from nacl.signing import SigningKey

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from tinymodels import write_tiny_llama

from meshllm.models.library import Library
from meshllm.models.manifest import build_manifest
from meshllm.models.store import ModelStore, Offer
from meshllm.models.transfer import DATA_FRAME, REPLY_FRAME_MAX
from meshllm.net import Endpoint, PeerConnection, Stream
from meshllm.wire.addr import parse_addr

BULK = "bench-bulk"


class Bulk(msgspec.Struct):
    nbytes: int


def _admit(_peer: str, _proof: bytes, _dialer: bool) -> None:
    return None


async def holder(model: Path, home: Path) -> None:
    """A holder process: serve ``model`` (model-fetch) and raw bulk streams until stdin closes."""
    key = SigningKey.generate()
    ep = await Endpoint.create(key, "127.0.0.1", 0, admit=_admit, local_proof=lambda: b"bench")
    library = Library(home / "models")
    library.add(model, source="file", owned=False)
    ModelStore(library, ep, key, list, lambda *a, **k: None)
    chunk = b"\x5a" * DATA_FRAME

    async def bulk(stream: Stream, _peer: PeerConnection) -> None:
        ask = await stream.recv(Bulk, timeout=10.0)
        if ask is None:
            return
        sent = 0
        while sent < ask.nbytes:
            await stream.send(chunk[: min(DATA_FRAME, ask.nbytes - sent)])
            sent += min(DATA_FRAME, ask.nbytes - sent)

    ep.on_stream(BULK, bulk)
    host, port = ep.local_addr
    print(json.dumps({"node_id": ep.node_id, "addr": f"{host}:{port}"}), flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
    await ep.close()


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far (Linux ``/proc``)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def start_holder(model: Path, home: Path) -> tuple[subprocess.Popen[str], dict[str, str]]:
    proc = subprocess.Popen([sys.executable, __file__, "--holder", str(model), "--home", str(home)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    return proc, json.loads(proc.stdout.readline())


async def run_bulk(info: dict[str, str], nbytes: int) -> float:
    ep = await Endpoint.create(SigningKey.generate(), "127.0.0.1", 0, admit=_admit, local_proof=lambda: b"bench")
    try:
        conn = await ep.connect(parse_addr(info["addr"]), info["node_id"], timeout=5.0)
        stream = await conn.open_stream(BULK, max_frame=REPLY_FRAME_MAX)
        started = time.perf_counter()
        await stream.send(Bulk(nbytes))
        got = 0
        while got < nbytes:
            frame = await stream.recv(bytes, timeout=30.0)
            assert frame is not None
            got += len(frame)
        return nbytes / (time.perf_counter() - started)
    finally:
        await ep.close()


async def run_stage(infos: list[dict[str, str]], model: Path, manifest: Any,
                    layers: tuple[int, int]) -> tuple[float, int]:
    key = SigningKey.generate()
    ep = await Endpoint.create(key, "127.0.0.1", 0, admit=_admit, local_proof=lambda: b"bench")
    with tempfile.TemporaryDirectory() as tmp:
        offers = [Offer(i["node_id"], i["addr"], manifest.model, model.stem, manifest.size) for i in infos]
        store = ModelStore(Library(Path(tmp) / "models"), ep, key, lambda: offers, lambda *a, **k: None)
        try:
            started = time.perf_counter()
            await store.stage_file(manifest, model.stem, *layers, [])
            took = time.perf_counter() - started
            view = next(iter(store.transfers.values()))
            return view.bytes_done / took, view.bytes_done
        finally:
            await ep.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--layers", default="1:7", help="layer range to fetch, START:END (of 8)")
    parser.add_argument("--out", default="bench/results/models.json")
    parser.add_argument("--holder", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--home", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.holder:
        asyncio.run(holder(args.holder, args.home))
        return
    start, end = (int(x) for x in args.layers.split(":"))
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        model = write_tiny_llama(root / "wide.gguf", n_layers=8, width=384, ffn=1536, seed=7)
        manifest = build_manifest(model)
        holders = [start_holder(model, root / f"h{i}") for i in range(2)]
        results: dict[str, list[float]] = {"bulk": [], "stage x1": [], "stage x2": []}
        cpu: dict[str, list[float]] = {k: [] for k in results}
        """CPU seconds (receiver + holders) per wall second of each run: how busy the 2 cores were."""
        receiver: dict[str, list[float]] = {k: [] for k in results}
        """The receiver's share alone (one Python process: it saturates at 1.0)."""
        nbytes = 0

        def measured(name: str, job: Any) -> Any:
            pids = [proc.pid for proc, _ in holders]
            before = [cpu_seconds(pid) for pid in pids] + [time.process_time()]
            wall = time.perf_counter()
            out = asyncio.run(job)
            wall = time.perf_counter() - wall
            after = [cpu_seconds(pid) for pid in pids] + [time.process_time()]
            cpu[name].append(sum(a - b for a, b in zip(after, before, strict=True)) / wall)
            receiver[name].append((after[-1] - before[-1]) / wall)
            return out

        try:
            for _ in range(args.runs):
                rate, nbytes = measured("stage x1", run_stage([holders[0][1]], model, manifest, (start, end)))
                results["stage x1"].append(rate)
                results["bulk"].append(measured("bulk", run_bulk(holders[0][1], nbytes)))
                results["stage x2"].append(measured("stage x2", run_stage([h[1] for h in holders], model, manifest,
                                                                          (start, end)))[0])
        finally:
            for proc, _ in holders:
                assert proc.stdin is not None
                proc.stdin.close()
                proc.wait(10)
    medians = {k: statistics.median(v) for k, v in results.items()}
    ratios = {"stage_x1_over_bulk": medians["stage x1"] / medians["bulk"],
              "stage_x2_over_x1": medians["stage x2"] / medians["stage x1"]}
    print(f"layers [{start}, {end}) of a {manifest.size / 1e6:.0f} MB model: {nbytes / 1e6:.1f} MB per transfer, "
          f"{args.runs} runs, medians")
    busy = {k: statistics.median(v) for k, v in cpu.items()}
    rx = {k: statistics.median(v) for k, v in receiver.items()}
    print(f"{'path':<10} {'MB/s':>8} {'cores busy':>11} {'receiver':>9}   runs (MB/s)")
    for name, runs in results.items():
        each = " ".join(f"{r / 1e6:.1f}" for r in runs)
        print(f"{name:<10} {medians[name] / 1e6:>8.1f} {busy[name]:>11.2f} {rx[name]:>9.2f}   {each}")
    print(f"stage x1 / bulk = {ratios['stage_x1_over_bulk']:.2f} (goal >= 0.7); "
          f"stage x2 / stage x1 = {ratios['stage_x2_over_x1']:.2f} (goal >= 1.5)")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"date": datetime.date.today().isoformat(), "layers": [start, end],
                               "bytes_per_transfer": nbytes, "runs": args.runs,
                               "medians_bytes_s": medians, "cores_busy": busy, "receiver_cores": rx,
                               "ratios": ratios, "raw": results}, indent=2))


if __name__ == "__main__":
    main()
