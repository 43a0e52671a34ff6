"""Transport benchmark: a meshllm QUIC connection vs plain asyncio TCP on loopback.

The server runs in a subprocess (``--serve quic|tcp``) so client and server do not share a
Python interpreter. Both stacks carry the same frames (``u32 length + msgpack``). Measured per
run on a fresh connection: connect time, 100 B and 8 KB request/response round trips, 10 MB on
one stream (and, for QUIC, the datagram-probe RTT). Reported: medians over runs and the
QUIC/TCP ratios, as a table and as JSON (``--out``). Also measured, side by side in-process: what a
garbage QUIC Initial costs an endpoint when it is checked with the client key alone
(``initial_decrypts``, what the endpoint does) against building a connection object for it (what
it did before issue 18).

    .venv/bin/python bench/net.py --runs 5
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
import time
from pathlib import Path

import msgspec
from nacl.signing import SigningKey

from meshllm.net import Endpoint, EndpointOptions
from meshllm.net.quic import MeshQuicConnection, initial_decrypts, make_configuration
from meshllm.wire.frames import FrameDecoder, encode_frame

BULK = 10 * 1024 * 1024
CHUNK = 64 * 1024
ROUND_TRIPS = 200


class Blob(msgspec.Struct):
    data: bytes


def accept(peer: str, proof: bytes, dialer: bool = False) -> None:
    """Benchmarks admit everyone."""


# -- servers (subprocess) ---------------------------------------------------------------------


async def serve_quic() -> None:
    async def echo(stream, peer) -> None:  # type: ignore[no-untyped-def]
        while (m := await stream.recv(Blob, timeout=60)) is not None:
            await stream.send(m)

    async def sink(stream, peer) -> None:  # type: ignore[no-untyped-def]
        total = 0
        while (m := await stream.recv(Blob, timeout=60)) is not None:
            total += len(m.data)
        await stream.send(total)

    ep = await Endpoint.create(SigningKey.generate(), "127.0.0.1", 0, admit=accept, local_proof=lambda: b"")
    ep.on_stream("echo", echo)
    ep.on_stream("sink", sink)
    print(ep.local_addr[1], flush=True)
    await asyncio.Event().wait()


async def serve_tcp() -> None:
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        mode = await reader.readexactly(1)
        decoder: FrameDecoder[Blob] = FrameDecoder(Blob)
        total = 0
        while data := await reader.read(CHUNK):
            for m in decoder.feed(data):
                if mode == b"e":
                    writer.write(encode_frame(m))
                else:
                    total += len(m.data)
        if mode == b"s":
            writer.write(encode_frame(total))
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    print(server.sockets[0].getsockname()[1], flush=True)
    await asyncio.Event().wait()


# -- clients ----------------------------------------------------------------------------------


async def run_quic(port: int) -> dict[str, float]:
    opts = EndpointOptions(probe_interval=0.05)
    ep = await Endpoint.create(
        SigningKey.generate(), "127.0.0.1", 0, admit=accept, local_proof=lambda: b"", options=opts
    )
    t0 = time.perf_counter()
    peer = await ep.connect(("127.0.0.1", port))
    out = {"connect_ms": (time.perf_counter() - t0) * 1000}
    stream = await peer.open_stream("echo")
    for size in (100, 8192):
        samples = []
        for _ in range(ROUND_TRIPS):
            t = time.perf_counter()
            await stream.send(Blob(b"x" * size))
            await stream.recv(Blob)
            samples.append(time.perf_counter() - t)
        out[f"rtt_{size}B_ms"] = statistics.median(samples) * 1000
    stream.close()
    out["probe_rtt_ms"] = peer.rtt_ms or float("nan")
    sink = await peer.open_stream("sink")
    t = time.perf_counter()
    for _ in range(BULK // CHUNK):
        await sink.send(Blob(b"y" * CHUNK))
    sink.close()
    assert await sink.recv(int, timeout=60) == BULK
    out["bulk_MBps"] = BULK / (time.perf_counter() - t) / 1e6
    await ep.close()
    return out


async def run_tcp(port: int) -> dict[str, float]:
    t0 = time.perf_counter()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    out = {"connect_ms": (time.perf_counter() - t0) * 1000}
    writer.write(b"e")
    decoder: FrameDecoder[Blob] = FrameDecoder(Blob)
    for size in (100, 8192):
        samples = []
        for _ in range(ROUND_TRIPS):
            t = time.perf_counter()
            writer.write(encode_frame(Blob(b"x" * size)))
            await writer.drain()
            while not decoder.feed(await reader.read(CHUNK)):
                pass
            samples.append(time.perf_counter() - t)
        out[f"rtt_{size}B_ms"] = statistics.median(samples) * 1000
    writer.close()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"s")
    t = time.perf_counter()
    for _ in range(BULK // CHUNK):
        writer.write(encode_frame(Blob(b"y" * CHUNK)))
        await writer.drain()
    writer.write_eof()
    total = FrameDecoder(int).feed(await reader.read())
    assert total == [BULK]
    out["bulk_MBps"] = BULK / (time.perf_counter() - t) / 1e6
    writer.close()
    return out


def garbage_initial() -> bytes:
    """1,200 random bytes under a valid QUIC v1 Initial header."""
    header = bytes([0xC0]) + (1).to_bytes(4, "big") + bytes([8]) + os.urandom(8) + bytes([8]) + os.urandom(8)
    header += b"\x00"
    body = 1200 - len(header) - 2
    return header + (0x4000 | body).to_bytes(2, "big") + os.urandom(body)


def initial_costs(count: int = 2000) -> dict[str, float]:
    """Microseconds per garbage Initial: key check alone vs a connection object fed the datagram."""
    packets = [garbage_initial() for _ in range(count)]
    config = make_configuration(SigningKey.generate(), is_client=False)
    start = time.perf_counter()
    assert not any(initial_decrypts(p, 8) for p in packets)
    checked = time.perf_counter() - start
    start = time.perf_counter()
    for p in packets:
        quic = MeshQuicConnection(configuration=config, original_destination_connection_id=p[6:14])
        quic.receive_datagram(p, ("127.0.0.1", 1), now=0.0)
    built = time.perf_counter() - start
    return {"initial_checked_us": checked / count * 1e6, "initial_connection_us": built / count * 1e6}


def start_server(kind: str) -> tuple[subprocess.Popen[bytes], int]:
    proc = subprocess.Popen([sys.executable, __file__, "--serve", kind], stdout=subprocess.PIPE)
    assert proc.stdout is not None
    return proc, int(proc.stdout.readline())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--out", default="bench/results/net.json")
    parser.add_argument("--serve", choices=["quic", "tcp"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        asyncio.run(serve_quic() if args.serve == "quic" else serve_tcp())
        return
    results: dict[str, list[dict[str, float]]] = {"quic": [], "tcp": []}
    servers = {kind: start_server(kind) for kind in results}
    try:
        for _ in range(args.runs):  # interleaved, so drift on shared hardware hits both alike
            results["quic"].append(asyncio.run(run_quic(servers["quic"][1])))
            results["tcp"].append(asyncio.run(run_tcp(servers["tcp"][1])))
    finally:
        for proc, _ in servers.values():
            proc.kill()
            proc.wait()
    medians = {k: {m: statistics.median(r[m] for r in runs) for m in runs[0]} for k, runs in results.items()}
    initials = [initial_costs() for _ in range(args.runs)]
    initial = {key: statistics.median(run[key] for run in initials) for key in initials[0]}
    rows = [("connect (ms)", "connect_ms"), ("100 B round trip (ms)", "rtt_100B_ms"),
            ("8 KB round trip (ms)", "rtt_8192B_ms"), ("10 MB one stream (MB/s)", "bulk_MBps")]
    table = ["| metric | meshllm QUIC | asyncio TCP | QUIC/TCP |", "|---|---|---|---|"]
    for label, key in rows:
        q, t = medians["quic"][key], medians["tcp"][key]
        table.append(f"| {label} | {q:.2f} | {t:.2f} | {q / t:.2f}x |")
    table.append(f"| datagram probe RTT (ms, EWMA) | {medians['quic']['probe_rtt_ms']:.2f} | - | - |")
    print("\n".join(table))
    print(f"garbage Initial: {initial['initial_checked_us']:.0f} us checked with the client key, "
          f"{initial['initial_connection_us']:.0f} us as a connection object "
          f"({initial['initial_connection_us'] / initial['initial_checked_us']:.1f}x)")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    report = {
        "date": datetime.date.today().isoformat(), "runs": args.runs, "medians": medians, "raw": results,
        "ratios": {key: medians["quic"][key] / medians["tcp"][key] for _, key in rows},
        "garbage_initial_us": initial,
    }
    out.write_text(json.dumps(report, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
