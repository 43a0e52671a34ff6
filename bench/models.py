"""Model transfer benchmark: layer transfers over QUIC and over the bulk channel (TLS on TCP), side by side.

Holders run in their own processes, each with an endpoint on 127.0.0.1 at **1,452-byte QUIC
datagrams** (an Ethernet path's MTU, set explicitly even on loopback), a copy of the model in its
library and its bulk channel open. The receiver is this process. Measured alternating, in one run:

- ``quic raw``: one QUIC stream of raw 256 KiB frames from one holder (no files, no hashing): the
  ceiling aioquic gives here as meshllm uses it;
- ``tls raw``: the same bytes over asyncio TCP + TLS 1.3 with both ends presenting node keys
  (``net/tcp_tls.py``): the ceiling of the bulk channel's transport;
- ``stage quic x1``: ``ModelStore.stage_file`` for a layer range from one holder over QUIC (what
  nodes did before the bulk channel);
- ``stage tls x1`` / ``x2``: the same over the bulk channel from one / two holders (pieces
  sha256-checked and written to disk);
- ``paced x1`` / ``x2``: the same with each holder's uplink held to ``--pace`` MB/s (a user-space
  token bucket in the holder: a home connection), one holder against two.

Reported per row: MB/s and the receiver's CPU seconds per MB (medians). Goals: ``stage tls x1`` >= 100
MB/s or >= 0.5x ``tls raw``; ``paced x2 / paced x1`` >= 1.8.

    .venv/bin/python bench/models.py [--runs 3] [--layers 1:7] [--raw-mb 64] [--pace 10] [--out ...]
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import statistics
import struct
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

from meshllm.models.bulk import BulkServer
from meshllm.models.library import Library
from meshllm.models.manifest import build_manifest
from meshllm.models.store import ModelStore, Offer
from meshllm.models.transfer import DATA_FRAME, REPLY_FRAME_MAX
from meshllm.net import Endpoint, EndpointOptions, PeerConnection, Stream, tcp_tls
from meshllm.wire.addr import parse_addr

BULK = "bench-bulk"
DATAGRAM = 1452
OPTIONS = EndpointOptions(max_datagram_size=DATAGRAM)
TLS_CHUNK = 1 << 20


class Bulk(msgspec.Struct):
    nbytes: int


def _admit(_peer: str, _proof: bytes, _dialer: bool) -> None:
    return None


class PacedBulkServer(BulkServer):
    """A bulk channel whose uplink (all its connections together) is held to ``rate`` bytes/s."""

    def __init__(self, *args: Any, rate: float, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.rate = rate
        self._next = 0.0

    async def send(self, writer: asyncio.StreamWriter, data: bytes) -> None:
        for at in range(0, len(data), 64 << 10):
            part = data[at:at + (64 << 10)]
            now = time.monotonic()
            slot = max(self._next, now)
            self._next = slot + len(part) / self.rate
            await asyncio.sleep(slot - now)
            await super().send(writer, part)


async def holder(model: Path, home: Path, pace: float) -> None:
    """A holder process: serve ``model`` (QUIC and bulk channel) and raw bulk streams until stdin closes."""
    key = SigningKey.generate()
    ep = await Endpoint.create(key, "127.0.0.1", 0, admit=_admit, local_proof=lambda: b"bench", options=OPTIONS)
    library = Library(home / "models")
    library.add(model, source="file", owned=False)
    store = ModelStore(library, ep, key, list, lambda *a, **k: None)
    if pace:
        store.bulk_server = PacedBulkServer(key, store.offered, lambda peer: peer in ep.peers, rate=pace)
    bulk_port = await store.start_bulk("127.0.0.1")
    chunk = b"\x5a" * DATA_FRAME

    async def bulk(stream: Stream, _peer: PeerConnection) -> None:
        ask = await stream.recv(Bulk, timeout=10.0)
        if ask is None:
            return
        sent = 0
        while sent < ask.nbytes:
            await stream.send(chunk[: min(DATA_FRAME, ask.nbytes - sent)])
            sent += min(DATA_FRAME, ask.nbytes - sent)

    server_ctx, _ = tcp_tls.contexts(key)
    tls_chunk = b"\x5a" * TLS_CHUNK

    async def tls_bulk(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        tcp_tls.peer_node_id(writer.get_extra_info("ssl_object"))
        nbytes = struct.unpack(">Q", await reader.readexactly(8))[0]
        while nbytes > 0:
            writer.write(tls_chunk[: min(TLS_CHUNK, nbytes)])
            await writer.drain()
            nbytes -= TLS_CHUNK
        writer.close()

    tls = await asyncio.start_server(tls_bulk, "127.0.0.1", 0, ssl=server_ctx)
    ep.on_stream(BULK, bulk)
    host, port = ep.local_addr
    print(json.dumps({"node_id": ep.node_id, "addr": f"{host}:{port}", "bulk_port": bulk_port,
                      "tls_port": tls.sockets[0].getsockname()[1]}), flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
    tls.close()
    await store.close()
    await ep.close()


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far (Linux ``/proc``)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def start_holder(model: Path, home: Path, pace: float = 0.0) -> tuple[subprocess.Popen[str], dict[str, Any]]:
    proc = subprocess.Popen([sys.executable, __file__, "--holder", str(model), "--home", str(home),
                             "--pace", str(pace)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    return proc, json.loads(proc.stdout.readline())


async def run_quic_raw(info: dict[str, Any], nbytes: int) -> float:
    ep = await Endpoint.create(SigningKey.generate(), "127.0.0.1", 0, admit=_admit, local_proof=lambda: b"bench",
                               options=OPTIONS)
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


async def run_tls_raw(info: dict[str, Any], nbytes: int) -> float:
    _, client_ctx = tcp_tls.contexts(SigningKey.generate())
    started = time.perf_counter()
    reader, writer = await asyncio.open_connection("127.0.0.1", info["tls_port"], ssl=client_ctx,
                                                   limit=2 * TLS_CHUNK)
    tcp_tls.check_peer(writer.get_extra_info("ssl_object"), info["node_id"])
    writer.write(struct.pack(">Q", nbytes))
    got = 0
    while got < nbytes:
        data = await asyncio.wait_for(reader.read(TLS_CHUNK), 30.0)
        assert data
        got += len(data)
    writer.close()
    return nbytes / (time.perf_counter() - started)


async def run_stage(infos: list[dict[str, Any]], model: Path, manifest: Any, layers: tuple[int, int],
                    *, bulk: bool) -> tuple[float, int]:
    key = SigningKey.generate()
    ep = await Endpoint.create(key, "127.0.0.1", 0, admit=_admit, local_proof=lambda: b"bench", options=OPTIONS)
    ports = {i["node_id"]: i["bulk_port"] for i in infos}
    with tempfile.TemporaryDirectory() as tmp:
        offers = [Offer(i["node_id"], i["addr"], manifest.model, model.stem, manifest.size) for i in infos]
        store = ModelStore(Library(Path(tmp) / "models"), ep, key, lambda: offers, lambda *a, **k: None,
                           bulk_ports=(lambda n: ports[n]) if bulk else None)
        try:
            started = time.perf_counter()
            await store.stage_file(manifest, model.stem, *layers, [])
            took = time.perf_counter() - started
            view = next(iter(store.transfers.values()))
            if bulk:
                assert sum(store.bulk.received.values()) >= view.bytes_done, "pieces did not ride the bulk channel"
            return view.bytes_done / took, view.bytes_done
        finally:
            await store.close()
            await ep.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--layers", default="1:7", help="layer range to fetch, START:END (of 8)")
    parser.add_argument("--raw-mb", type=float, default=64.0, help="MB per raw transfer")
    parser.add_argument("--pace", type=float, default=10.0, help="paced holders' uplink, MB/s")
    parser.add_argument("--out", default="bench/results/models.json")
    parser.add_argument("--holder", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--home", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.holder:
        asyncio.run(holder(args.holder, args.home, args.pace))
        return
    start, end = (int(x) for x in args.layers.split(":"))
    raw = int(args.raw_mb * 1e6)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        model = write_tiny_llama(root / "wide.gguf", n_layers=8, width=384, ffn=1536, seed=7)
        manifest = build_manifest(model)
        holders = [start_holder(model, root / f"h{i}") for i in range(2)]
        paced = [start_holder(model, root / f"p{i}", args.pace * 1e6) for i in range(2)]
        infos = [h[1] for h in holders]
        pinfos = [h[1] for h in paced]
        jobs: dict[str, Any] = {
            "quic raw": lambda: run_quic_raw(infos[0], raw),
            "tls raw": lambda: run_tls_raw(infos[0], raw),
            "stage quic x1": lambda: run_stage(infos[:1], model, manifest, (start, end), bulk=False),
            "stage tls x1": lambda: run_stage(infos[:1], model, manifest, (start, end), bulk=True),
            "stage tls x2": lambda: run_stage(infos, model, manifest, (start, end), bulk=True),
            "paced x1": lambda: run_stage(pinfos[:1], model, manifest, (start, end), bulk=True),
            "paced x2": lambda: run_stage(pinfos, model, manifest, (start, end), bulk=True),
        }
        results: dict[str, list[float]] = {k: [] for k in jobs}
        rx_cpu: dict[str, list[float]] = {k: [] for k in jobs}
        """The receiver's CPU seconds per MB received (this process, all its threads)."""
        busy: dict[str, list[float]] = {k: [] for k in jobs}
        """CPU seconds (receiver + holders) per wall second: how busy the 2 cores were."""
        nbytes = 0
        pids = [proc.pid for proc, _ in holders + paced]
        try:
            for _ in range(args.runs):
                for name, job in jobs.items():
                    before = [cpu_seconds(pid) for pid in pids] + [time.process_time()]
                    wall = time.perf_counter()
                    out = asyncio.run(job())
                    wall = time.perf_counter() - wall
                    after = [cpu_seconds(pid) for pid in pids] + [time.process_time()]
                    rate, moved = out if isinstance(out, tuple) else (out, raw)
                    nbytes = moved if name.startswith("stage") else nbytes
                    results[name].append(rate)
                    rx_cpu[name].append((after[-1] - before[-1]) / (moved / 1e6))
                    busy[name].append(sum(a - b for a, b in zip(after, before, strict=True)) / wall)
        finally:
            for proc, _ in holders + paced:
                assert proc.stdin is not None
                proc.stdin.close()
                proc.wait(10)
    medians = {k: statistics.median(v) for k, v in results.items()}
    rx = {k: statistics.median(v) for k, v in rx_cpu.items()}
    cores = {k: statistics.median(v) for k, v in busy.items()}
    ratios = {"tls_raw_over_quic_raw": medians["tls raw"] / medians["quic raw"],
              "stage_tls_x1_over_tls_raw": medians["stage tls x1"] / medians["tls raw"],
              "stage_tls_x1_over_stage_quic_x1": medians["stage tls x1"] / medians["stage quic x1"],
              "stage_tls_x2_over_x1": medians["stage tls x2"] / medians["stage tls x1"],
              "paced_x2_over_x1": medians["paced x2"] / medians["paced x1"]}
    print(f"QUIC at {DATAGRAM}-byte datagrams; raw rows {raw / 1e6:.0f} MB; stage rows: layers [{start}, {end}) "
          f"of a {manifest.size / 1e6:.0f} MB model ({nbytes / 1e6:.1f} MB); paced holders {args.pace:.0f} MB/s each; "
          f"{args.runs} runs, medians")
    print(f"| {'path':<14} | {'MB/s':>7} | {'receiver CPU s/MB':>17} | {'cores busy':>10} | runs (MB/s)")
    print(f"|{'-' * 16}|{'-' * 9}|{'-' * 19}|{'-' * 12}|---")
    for name, runs in results.items():
        each = " ".join(f"{r / 1e6:.1f}" for r in runs)
        print(f"| {name:<14} | {medians[name] / 1e6:>7.1f} | {rx[name]:>17.4f} | {cores[name]:>10.2f} | {each}")
    print(f"tls raw / quic raw = {ratios['tls_raw_over_quic_raw']:.1f}; "
          f"stage tls x1 = {medians['stage tls x1'] / 1e6:.0f} MB/s = "
          f"{ratios['stage_tls_x1_over_tls_raw']:.2f} x tls raw "
          f"(goal >= 100 MB/s or >= 0.5); stage tls x1 / stage quic x1 = "
          f"{ratios['stage_tls_x1_over_stage_quic_x1']:.1f}; paced x2 / x1 = {ratios['paced_x2_over_x1']:.2f} "
          f"(goal >= 1.8)")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"date": datetime.date.today().isoformat(), "datagram_bytes": DATAGRAM,
                               "layers": [start, end], "stage_bytes": nbytes, "raw_bytes": raw,
                               "pace_bytes_s": args.pace * 1e6, "runs": args.runs,
                               "medians_bytes_s": medians, "receiver_cpu_s_per_mb": rx, "cores_busy": cores,
                               "ratios": ratios, "raw": results, "raw_receiver_cpu_s_per_mb": rx_cpu}, indent=2))


if __name__ == "__main__":
    main()
