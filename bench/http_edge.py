"""How well a node's HTTP API keeps answering under abuse: ``/health`` latency side by side, one run.

Starts a real node (``meshllm serve``, under a 1,024-descriptor limit like a default Linux shell),
then measures ``GET /health`` round trips (a fresh connection each, as a load balancer's probe) in
three phases, ``--probes`` each:

- ``idle``: nothing else happening;
- ``slowloris``: while ``--connections`` half-open connections (request line and one header, then
  nothing) are held and more keep arriving;
- ``huge_prompts``: while ``--prompts`` clients each post a chat whose prompt fills the body cap
  (4 MiB) to the node's model (``--model``, default the bundled Gemma 3 270M: tokenizing 4 MiB
  with its vocabulary takes seconds, on the engine's worker thread).

then ``idle_after`` again. Prints medians, p90 and max per phase and the ratio of each median to the
mean of the two idle medians (the machine is shared: idle is measured before and after), and the
statuses the huge prompts got; writes JSON.

Usage: ``python bench/http_edge.py [--model default] [--probes 40] [--connections 1100] [--prompts 4]
[--out bench/results/http_edge.json]``
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from nodes import NodeProcess, running_nodes

BODY_CAP = 4 * 1024 * 1024


def probe(api: str, count: int, pause: float = 0.05) -> list[float]:
    """``count`` health checks, each on a new connection; milliseconds (a timeout counts as 10 s)."""
    samples = []
    for _ in range(count):
        started = time.perf_counter()
        try:
            ok = httpx.get(api + "/health", timeout=10).status_code == 200
        except httpx.HTTPError:
            ok = False
        samples.append((time.perf_counter() - started) * 1000 if ok else 10_000.0)
        time.sleep(pause)
    return samples


def summary(samples: list[float]) -> dict[str, float]:
    ordered = sorted(samples)
    return {"median_ms": round(statistics.median(ordered), 2), "p90_ms": round(ordered[int(len(ordered) * 0.9)], 2),
            "max_ms": round(ordered[-1], 2), "n": len(ordered)}


def hold_half_open(api: str, count: int, stop: threading.Event) -> None:
    host, port = api.removeprefix("http://").rsplit(":", 1)
    socks = []
    try:
        while not stop.is_set():
            for _ in range(count if not socks else 20):
                try:
                    sock = socket.create_connection((host, int(port)), timeout=5)
                    sock.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: ")
                    socks.append(sock)
                except OSError:
                    break
            stop.wait(0.5)
    finally:
        for sock in socks:
            sock.close()


def post_huge(api: str, model: str, stop: threading.Event, outcomes: list[int]) -> None:
    filler = "The quick brown fox jumps over the lazy dog. "
    text = (filler * (BODY_CAP // len(filler)))[: BODY_CAP - 4096]
    body = json.dumps({"model": model, "max_tokens": 1, "messages": [{"role": "user", "content": text}]})
    while not stop.is_set():
        try:
            outcomes.append(httpx.post(api + "/v1/chat/completions", content=body, timeout=120,
                                       headers={"content-type": "application/json"}).status_code)
        except httpx.HTTPError:
            outcomes.append(0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--probes", type=int, default=40)
    parser.add_argument("--connections", type=int, default=1100)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--out", type=Path, default=Path("bench/results/http_edge.json"))
    args = parser.parse_args()
    phases: dict[str, list[float]] = {}
    outcomes: list[int] = []
    with tempfile.TemporaryDirectory() as tmp, running_nodes() as nodes:
        limit = ["prlimit", "--nofile=1024:1024", "--"]
        node = NodeProcess(Path(tmp) / "n", ["--model", args.model], "n", prefix=limit)
        nodes.append(node)
        node.wait_ready(timeout=300)
        model = httpx.get(node.api + "/v1/models").json()["data"][0]["id"]
        phases["idle"] = probe(node.api, args.probes)
        stop = threading.Event()
        attacker = threading.Thread(target=hold_half_open, args=(node.api, args.connections, stop), daemon=True)
        attacker.start()
        time.sleep(2.0)
        phases["slowloris"] = probe(node.api, args.probes)
        stop.set()
        attacker.join(30)
        stop = threading.Event()
        senders = [threading.Thread(target=post_huge, args=(node.api, model, stop, outcomes), daemon=True)
                   for _ in range(args.prompts)]
        for sender in senders:
            sender.start()
        time.sleep(2.0)
        phases["huge_prompts"] = probe(node.api, args.probes)
        stop.set()
        for sender in senders:
            sender.join(120)
        phases["idle_after"] = probe(node.api, args.probes)
    results = {name: summary(samples) for name, samples in phases.items()}
    idle = statistics.mean([results["idle"]["median_ms"], results["idle_after"]["median_ms"]])
    print(f"{'phase':<14} {'median ms':>10} {'p90 ms':>10} {'max ms':>10} {'x idle':>8}")
    for name, row in results.items():
        print(f"{name:<14} {row['median_ms']:>10.1f} {row['p90_ms']:>10.1f} {row['max_ms']:>10.1f} "
              f"{row['median_ms'] / idle:>8.2f}")
    codes = {str(code): outcomes.count(code) for code in sorted(set(outcomes))}
    print(f"huge prompts answered: {codes}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"model": args.model, "connections": args.connections, "prompts": args.prompts,
                                    "results": results, "huge_prompt_statuses": codes}, indent=2))


if __name__ == "__main__":
    main()
