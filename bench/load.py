"""Sustained load: concurrent streaming clients over a small mesh, counting every request's fate.

Three real nodes: two serve the model, one is a ``--client`` that routes everything over QUIC.
``--clients`` streaming clients (spread evenly over the three APIs) each send requests back to
back for ``--duration`` seconds. Every request ends as exactly one of:

* ``completed``: the stream ended with a finish chunk and ``[DONE]``;
* ``failed``: an HTTP error status or an error event in the stream (a clean, reported failure);
* ``lost``: no clean end within the request deadline, or the connection dropped silently (must be 0).

Reported: counts, p50/p99 request latency, tokens/s over the mesh, peak RSS of each node.
The tiny test model is the default here: on a 2-core host the bundled model would measure the CPU,
not the serving path (``--model default`` runs it anyway).

    .venv/bin/python bench/load.py [--clients 32] [--duration 60] [--max-tokens 32] [--model tiny|default]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from collections import Counter
from datetime import UTC, datetime
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from nodes import NodeProcess, running_nodes, wait_until
from tinymodels import write_tiny_llama

REQUEST_DEADLINE_S = 60.0


async def one_request(http: httpx.AsyncClient, api: str, model: str, max_tokens: int, i: int) -> tuple[str, float, int]:
    """(outcome, seconds, completion tokens) of one streamed chat request."""
    body = {"model": model, "messages": [{"role": "user", "content": f"Tell me story number {i}."}],
            "max_tokens": max_tokens, "stream": True, "stream_options": {"include_usage": True}, "user": f"u{i}"}
    start = time.monotonic()
    tokens, finished, done = 0, False, False
    try:
        async with asyncio.timeout(REQUEST_DEADLINE_S):
            async with http.stream("POST", f"{api}/v1/chat/completions", json=body) as response:
                if response.status_code != 200:
                    await response.aread()
                    return "failed", time.monotonic() - start, 0
                async for line in response.aiter_lines():
                    if line == "data: [DONE]":
                        done = True
                    elif line.startswith("data: "):
                        chunk = json.loads(line[6:])
                        if "error" in chunk:
                            return "failed", time.monotonic() - start, 0
                        if chunk.get("usage"):
                            tokens = chunk["usage"]["completion_tokens"]
                        elif chunk["choices"] and chunk["choices"][0]["finish_reason"]:
                            finished = True
    except (TimeoutError, httpx.HTTPError):
        return "lost", time.monotonic() - start, 0
    return ("completed" if finished and done else "lost"), time.monotonic() - start, tokens


async def client_loop(api: str, model: str, max_tokens: int, until: float, seed: int,
                      results: list[tuple[str, float, int]]) -> None:
    async with httpx.AsyncClient(timeout=REQUEST_DEADLINE_S, trust_env=False) as http:
        i = seed
        while time.monotonic() < until:
            results.append(await one_request(http, api, model, max_tokens, i))
            i += 1000


def peak_rss_mb(pid: int) -> float:
    """VmHWM of a running process, in MiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return 0.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--duration", type=float, default=60.0)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--model", choices=["tiny", "default"], default="tiny")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "load.json")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp, running_nodes() as nodes:
        spec = str(write_tiny_llama(Path(tmp) / "tiny.gguf", seed=0)) if args.model == "tiny" else "default"
        model = "tiny" if args.model == "tiny" else "gemma-3-270m-q4_k_m"
        s0 = NodeProcess(Path(tmp) / "s0", ["--model", spec], "s0")
        nodes.append(s0)
        token = s0.wait_ready()["invite"]
        nodes.append(NodeProcess(Path(tmp) / "s1", ["--model", spec, "--join", token], "s1"))
        nodes.append(NodeProcess(Path(tmp) / "c", ["--client", "--join", token], "c"))
        for node in nodes:
            node.wait_ready()
        wait_until(lambda: len(httpx.get(f"{nodes[2].api}/v1/models").json()["data"][0]["nodes"]) == 2
                   if httpx.get(f"{nodes[2].api}/v1/models").json()["data"] else False, 15)
        results: list[tuple[str, float, int]] = []
        started = time.monotonic()
        until = started + args.duration

        async def run() -> None:
            await asyncio.gather(*(client_loop(nodes[i % 3].api, model, args.max_tokens, until, i, results)
                                   for i in range(args.clients)))

        asyncio.run(run())
        elapsed = time.monotonic() - started
        rss = {n.name: round(peak_rss_mb(n.proc.pid), 1) for n in nodes}
        counters = {n.name: n.status()["requests"] for n in nodes}

    outcomes = Counter(r[0] for r in results)
    latencies = sorted(r[1] for r in results if r[0] == "completed")
    tokens = sum(r[2] for r in results)
    p50 = statistics.median(latencies) if latencies else 0.0
    p99 = latencies[min(len(latencies) - 1, int(len(latencies) * 0.99))] if latencies else 0.0
    summary = {"completed": outcomes["completed"], "failed": outcomes["failed"], "lost": outcomes["lost"],
               "p50_s": round(p50, 3), "p99_s": round(p99, 3), "tok_s": round(tokens / elapsed, 1),
               "req_s": round(len(results) / elapsed, 2), "peak_rss_mb": rss, "node_counters": counters}
    print(f"{args.clients} streaming clients over 3 nodes (2 serve {model}, 1 routes), {elapsed:.0f} s, "
          f"max_tokens {args.max_tokens}")
    header = ("completed", "failed", "lost", "p50 s", "p99 s", "req/s", "tok/s")
    print(" ".join(f"{h:>{w}}" for h, w in zip(header, (9, 6, 4, 6, 6, 6, 6), strict=True)) + "  peak RSS MiB")
    print(f"{summary['completed']:9d} {summary['failed']:6d} {summary['lost']:4d} {p50:6.2f} {p99:6.2f} "
          f"{summary['req_s']:6.2f} {summary['tok_s']:6.1f}  " + ", ".join(f"{k} {v}" for k, v in rss.items()))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({
        "bench": "load", "when": datetime.now(UTC).isoformat(timespec="seconds"), "host": platform.node(),
        "cpus": os.cpu_count(), "model": model, "clients": args.clients, "duration_s": round(elapsed, 1),
        "max_tokens": args.max_tokens, "results": summary}, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
