"""Many users at once: one node with ``--parallel 1`` against one with ``--parallel 8``, side by side.

``slots`` (the default): two real nodes (``meshllm serve``), one per ``--parallel`` value, serve the
same model on the same machine; for each number of concurrent streams (1, 2, 4, 8) each node gets,
in turn, ``streams`` streaming chat clients that send ``--requests`` requests each, back to back.
Reported per (slots, streams): aggregate tokens/s (completion tokens over the wall time of the
round), time to first token p50/p99, and the ratio of the two nodes' aggregates. Rounds alternate
between the nodes so a noisy moment on this shared host hits both alike.

``split``: the same table for a 2-stage split of the model: per ``--split-batch`` value (1: one
session's step at a time; 8: the steps of up to 8 sessions in one pass) a coordinator node
(``--split force --stages 2``) and a worker node of its own, all started through the CLI; rounds
alternate between the two chains. The nodes get the ``--max-memory`` that leaves one chain to
choose (``--shape``): by default the even split (left ``free``, the planner gives all layers but one
to the node that measured faster, which differs from one start to the next on a busy host);
``first-heavy`` puts all but one on the coordinator.

``mesh``: the sustained mesh test: 32 streaming clients over three nodes (two serve, one
``--client`` routes) for ``--duration`` seconds; every request ends ``completed``, ``failed`` (a
clean error, e.g. a 429 when saturated) or ``lost`` (no clean end: must be 0).

``steps``: what one llama.cpp call costs by its rows (1, 2, 4, 8 sequences decoding one token each,
and a 64-token prefill chunk), with the engine's ``exact`` and ``fast`` kernels, each in processes
of its own (ggml reads its kernel switch once per process), alternating; medians. It explains the
ceiling of batching on a CPU: a lone row is bandwidth-bound, a batch compute-bound.

    .venv/bin/python bench/load.py [--model default|tiny] [--streams 1,2,4,8] [--parallel 1,8] [--requests 3]
    .venv/bin/python bench/load.py --mode split [--model default|tiny] [--streams 1,2,4,8] [--split-batch 1,8]
        [--shape even|first-heavy|free]
    .venv/bin/python bench/load.py --mode mesh [--clients 32] [--duration 60] [--model tiny]
    .venv/bin/python bench/load.py --mode steps [--runs 4]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from nodes import NodeProcess, running_nodes, wait_until
from tinymodels import write_tiny_llama

from meshllm.models import resolve_model
from meshllm.split.placement import SplitOptions, model_profile

REQUEST_DEADLINE_S = 300.0


@dataclass
class Outcome:
    """One streamed request."""

    status: str
    """``completed``, ``failed`` (an error status or error event) or ``lost`` (no clean end)."""
    seconds: float
    ttft_s: float | None
    tokens: int


async def one_request(http: httpx.AsyncClient, api: str, model: str, max_tokens: int, i: int) -> Outcome:
    """A streamed chat request with a prompt of its own (no prompt-cache reuse between requests)."""
    body = {"model": model, "messages": [{"role": "user", "content": f"Tell me story number {i}."}],
            "max_tokens": max_tokens, "temperature": 0, "stream": True, "stream_options": {"include_usage": True},
            "user": f"u{i}"}
    start = time.monotonic()
    tokens, first, finished, done = 0, None, False, False
    try:
        async with asyncio.timeout(REQUEST_DEADLINE_S):
            async with http.stream("POST", f"{api}/v1/chat/completions", json=body) as response:
                if response.status_code != 200:
                    await response.aread()
                    return Outcome("failed", time.monotonic() - start, None, 0)
                async for line in response.aiter_lines():
                    if line == "data: [DONE]":
                        done = True
                    elif line.startswith("data: "):
                        chunk = json.loads(line[6:])
                        if "error" in chunk:
                            return Outcome("failed", time.monotonic() - start, first, 0)
                        if chunk.get("usage"):
                            tokens = chunk["usage"]["completion_tokens"]
                        elif chunk["choices"]:
                            choice = chunk["choices"][0]
                            if first is None and choice["delta"].get("content"):
                                first = time.monotonic() - start
                            finished = finished or bool(choice["finish_reason"])
    except (TimeoutError, httpx.HTTPError):
        return Outcome("lost", time.monotonic() - start, first, 0)
    return Outcome("completed" if finished and done else "lost", time.monotonic() - start, first, tokens)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(len(ordered) * q))] if ordered else 0.0


# ---- slots: --parallel 1 vs --parallel 8 ----------------------------------------------------

async def round_of(api: str, model: str, streams: int, requests: int, max_tokens: int, base: int
                   ) -> tuple[float, list[Outcome]]:
    """``streams`` clients, ``requests`` each back to back; (wall seconds, outcomes)."""
    async def client(s: int) -> list[Outcome]:
        async with httpx.AsyncClient(timeout=REQUEST_DEADLINE_S, trust_env=False) as http:
            return [await one_request(http, api, model, max_tokens, base + s * 1000 + r) for r in range(requests)]

    started = time.monotonic()
    results = await asyncio.gather(*(client(s) for s in range(streams)))
    return time.monotonic() - started, [o for per in results for o in per]


def side_by_side(args: argparse.Namespace, apis: dict[int, str], model: str, key: str) -> list[dict[str, object]]:
    """Each stream count on each server in turn (so a noisy moment hits all alike); a row per (server, streams)."""
    for api in apis.values():
        asyncio.run(round_of(api, model, 1, 1, 4, 999_000))  # warm up
    rows: list[dict[str, object]] = []
    base = 0
    for streams in args.streams:
        for value, api in apis.items():
            base += 100_000
            wall, outcomes = asyncio.run(round_of(api, model, streams, args.requests, args.max_tokens, base))
            ok = [o for o in outcomes if o.status == "completed"]
            ttfts = [o.ttft_s for o in ok if o.ttft_s is not None]
            row = {key: value, "streams": streams, "requests": len(outcomes),
                   "completed": len(ok), "failed": sum(o.status == "failed" for o in outcomes),
                   "lost": sum(o.status == "lost" for o in outcomes), "wall_s": round(wall, 2),
                   "tokens": sum(o.tokens for o in ok), "tok_s": round(sum(o.tokens for o in ok) / wall, 2),
                   "ttft_p50_s": round(statistics.median(ttfts), 3) if ttfts else None,
                   "ttft_p99_s": round(percentile(ttfts, 0.99), 3) if ttfts else None}
            rows.append(row)
            print(f"  {key} {value} streams {streams}: {row['tok_s']} tok/s, TTFT p50 {row['ttft_p50_s']} s "
                  f"p99 {row['ttft_p99_s']} s ({row['completed']}/{row['requests']} completed)", flush=True)
    return rows


def table(args: argparse.Namespace, rows: list[dict[str, object]], key: str, short: str) -> dict[int, float | None]:
    """Print aggregate tok/s and TTFT p50/p99 per stream count, the servers side by side; the ratios."""
    values = sorted({int(r[key]) for r in rows})  # type: ignore[call-overload]
    lo, hi = values[0], values[-1]
    print(f"{'streams':>7} | " + " | ".join(f"{short + str(v) + ' tok/s':>11} {'TTFT p50':>8} {'p99':>6}"
                                            for v in values) + f" | {f'{short}{hi}/{short}{lo}':>8}")
    by = {(r[key], r["streams"]): r for r in rows}
    ratios = {}
    for streams in args.streams:
        cells = []
        for v in values:
            r = by[(v, streams)]
            cells.append(f"{r['tok_s']:>11} {r['ttft_p50_s']!s:>8} {r['ttft_p99_s']!s:>6}")
        base = float(by[(lo, streams)]["tok_s"])  # type: ignore[arg-type]
        ratio = float(by[(hi, streams)]["tok_s"]) / base if base else None  # type: ignore[arg-type]
        ratios[streams] = round(ratio, 2) if ratio is not None else None
        print(f"{streams:>7} | " + " | ".join(cells) + (f" | {ratio:>7.2f}x" if ratio is not None else " |      n/a"))
    return ratios


def bench_slots(args: argparse.Namespace, spec: str, model: str, tmp: Path) -> dict[str, object]:
    with running_nodes() as nodes:
        servers = {}
        for parallel in args.parallel:
            node = NodeProcess(tmp / f"p{parallel}", ["--model", spec, "--parallel", str(parallel),
                                                      "--threads", str(args.threads)], f"p{parallel}")
            nodes.append(node)
            servers[parallel] = node
        for node in servers.values():
            node.wait_ready(120)
        rows = side_by_side(args, {p: n.api for p, n in servers.items()}, model, "parallel")
    print(f"\n{model}: {args.requests} requests per stream, max_tokens {args.max_tokens}, greedy, "
          f"--threads {args.threads}")
    return {"rows": rows, "ratio_tok_s": table(args, rows, "parallel", "p")}


# ---- split: a 2-stage chain batching its sessions vs one session at a time ----------------

def shape_memory(spec: str, shape: str) -> tuple[float | None, float | None]:
    """``--max-memory`` GiB of the coordinator and of the worker (None: uncapped) that leave one 2-stage
    chain of ``spec``'s model (at the planner's default context) to choose: ``even`` holds half the
    layers on each, ``first-heavy`` all but one on the coordinator. Half a layer to spare, so that
    the stage with the larger ends still fits and neither fits one more."""
    if shape == "free":
        return None, None
    profile = model_profile(resolve_model(spec, progress=False).path, SplitOptions().context)
    ends = max(profile.ends_bytes(True, False), profile.ends_bytes(False, True))
    if shape == "first-heavy":
        return None, (ends + 1.5 * profile.layer_bytes) / 2**30
    even = (ends + (-(-profile.n_layers // 2) + 0.5) * profile.layer_bytes) / 2**30
    return even, even


def bench_split(args: argparse.Namespace, spec: str, model: str, tmp: Path) -> dict[str, object]:
    """Per ``--split-batch`` value a coordinator (``--split force --stages 2``) and a worker of its own,
    capped to the chain ``--shape`` names (:func:`shape_memory`)."""
    first, rest = shape_memory(spec, args.shape)
    caps = [["--max-memory", f"{gib:.6f}"] if gib else [] for gib in (first, rest)]
    with running_nodes() as nodes:
        coords = {}
        for batch in args.split_batch:
            coord = NodeProcess(tmp / f"b{batch}", ["--model", spec, "--split", "force", "--stages", "2",
                                                    "--split-batch", str(batch), "--speculate", "off",
                                                    "--threads", str(args.threads), *caps[0]], f"b{batch}")
            nodes.append(coord)
            token = coord.wait_ready(120)["invite"]
            nodes.append(NodeProcess(tmp / f"w{batch}", ["--worker", "--join", token, "--threads",
                                                         str(args.threads), *caps[1]], f"w{batch}"))
            coords[batch] = coord
        chains = {}
        for batch, coord in coords.items():
            ready = coord.wait_event(lambda e: e["type"] == "split_ready", 600)  # workers fetch their layers
            chains[batch] = ready["stages"]
            print(f"  --split-batch {batch}: chain {chains[batch]}", flush=True)
        rows = side_by_side(args, {b: c.api for b, c in coords.items()}, model, "split_batch")
        batching = {b: c.status()["splits"][0]["batching"] for b, c in coords.items()}
    print(f"\n{model} on a 2-stage split ({', '.join(f'--split-batch {b}: {chains[b]}' for b in chains)}): "
          f"{args.requests} requests per stream, max_tokens {args.max_tokens}, greedy, --threads {args.threads}")
    ratios = table(args, rows, "split_batch", "b")
    print("passes: " + ", ".join(f"--split-batch {b}: {s['passes']} passes, mean {s['mean_batch']} sessions"
                                 if s else f"--split-batch {b}: no chain at the end" for b, s in batching.items()))
    return {"rows": rows, "ratio_tok_s": ratios, "chains": chains, "batching": batching}


# ---- mesh: sustained load over three nodes --------------------------------------------------

async def client_loop(api: str, model: str, max_tokens: int, until: float, seed: int, results: list[Outcome]) -> None:
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


def bench_mesh(args: argparse.Namespace, spec: str, model: str, tmp: Path) -> dict[str, object]:
    with running_nodes() as nodes:
        s0 = NodeProcess(tmp / "s0", ["--model", spec], "s0")
        nodes.append(s0)
        token = s0.wait_ready(120)["invite"]
        nodes.append(NodeProcess(tmp / "s1", ["--model", spec, "--join", token], "s1"))
        nodes.append(NodeProcess(tmp / "c", ["--client", "--join", token], "c"))
        for node in nodes:
            node.wait_ready(120)
        wait_until(lambda: len(httpx.get(f"{nodes[2].api}/v1/models").json()["data"][0]["nodes"]) == 2
                   if httpx.get(f"{nodes[2].api}/v1/models").json()["data"] else False, 15)
        results: list[Outcome] = []
        started = time.monotonic()

        async def run() -> None:
            until = started + args.duration
            await asyncio.gather(*(client_loop(nodes[i % 3].api, model, args.max_tokens, until, i, results)
                                   for i in range(args.clients)))

        asyncio.run(run())
        elapsed = time.monotonic() - started
        rss = {n.name: round(peak_rss_mb(n.proc.pid), 1) for n in nodes}
        counters = {n.name: n.status()["requests"] for n in nodes}
    outcomes = Counter(r.status for r in results)
    latencies = [r.seconds for r in results if r.status == "completed"]
    ttfts = [r.ttft_s for r in results if r.status == "completed" and r.ttft_s is not None]
    summary = {"completed": outcomes["completed"], "failed": outcomes["failed"], "lost": outcomes["lost"],
               "p50_s": round(statistics.median(latencies), 3) if latencies else 0.0,
               "p99_s": round(percentile(latencies, 0.99), 3), "ttft_p50_s": round(statistics.median(ttfts), 3)
               if ttfts else 0.0, "ttft_p99_s": round(percentile(ttfts, 0.99), 3),
               "tok_s": round(sum(r.tokens for r in results) / elapsed, 1), "req_s": round(len(results) / elapsed, 2),
               "peak_rss_mb": rss, "node_counters": counters, "duration_s": round(elapsed, 1)}
    print(f"{args.clients} streaming clients over 3 nodes (2 serve {model}, 1 routes), {elapsed:.0f} s, "
          f"max_tokens {args.max_tokens}")
    print(json.dumps({k: v for k, v in summary.items() if k != "node_counters"}))
    return summary


# ---- steps: the cost of one call by its rows ------------------------------------------------

STEP_ROWS = (1, 2, 4, 8)


def steps_child(path: str, kernels: str, threads: int) -> dict[str, float]:
    """(In a process of its own.) Median milliseconds per decode call of 1/2/4/8 rows and per 64-token chunk."""
    from meshllm.engine.llama_native import NativeContext, NativeModel, use_row_exact_kernels

    if kernels == "exact":
        use_row_exact_kernels()
    model = NativeModel(Path(path), repack=kernels == "fast")
    ctx = NativeContext(model, n_seq=9, n_ctx_seq=1024, n_batch=65, threads=threads)
    for seq in range(8):
        ctx.decode([100 + i for i in range(20)], list(range(20)), [seq] * 20, [False] * 19 + [True])
    out: dict[str, float] = {}
    for rows in STEP_ROWS:
        times = []
        for _ in range(15):
            started = time.perf_counter()
            ctx.decode([200] * rows, [ctx.length(s) for s in range(rows)], list(range(rows)), [True] * rows)
            times.append(time.perf_counter() - started)
        out[f"decode_{rows}_ms"] = statistics.median(times) * 1000
    times = []
    for _ in range(5):
        ctx.trim(8, 0)
        started = time.perf_counter()
        ctx.decode([300 + i for i in range(64)], list(range(64)), [8] * 64, [False] * 63 + [True])
        times.append(time.perf_counter() - started)
    out["prefill_64_ms"] = statistics.median(times) * 1000
    return out


def bench_steps(args: argparse.Namespace, spec: str, model: str, tmp: Path) -> dict[str, object]:
    path = spec if args.model == "tiny" else str(resolve_model("default", progress=False).path)
    runs: dict[str, list[dict[str, float]]] = {"exact": [], "fast": []}
    for _ in range(args.runs):
        for kernels in runs:
            done = subprocess.run([sys.executable, __file__, "--mode", "steps-child", "--kernels", kernels,
                                   "--path", path, "--threads", str(args.threads)],
                                  capture_output=True, text=True, timeout=300, check=True)
            runs[kernels].append(json.loads(done.stdout.strip().splitlines()[-1]))
    medians = {k: {m: round(statistics.median(r[m] for r in v), 1) for m in v[0]} for k, v in runs.items()}
    print(f"{model}: ms per llama.cpp call, --threads {args.threads}, medians of {args.runs} processes each")
    keys = list(medians["exact"])
    print(f"{'kernels':8} " + " ".join(f"{k:>14}" for k in keys) + f" {'8 rows vs 8 x 1':>16}")
    for kernels, row in medians.items():
        ratio = 8 * row["decode_1_ms"] / row["decode_8_ms"]
        print(f"{kernels:8} " + " ".join(f"{row[k]:14.1f}" for k in keys) + f" {ratio:15.2f}x")
    return {"medians": medians, "runs": runs}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mode", choices=["slots", "split", "mesh", "steps", "steps-child"], default="slots")
    parser.add_argument("--model", choices=["tiny", "default"], default="default")
    parser.add_argument("--streams", type=lambda s: [int(x) for x in s.split(",")], default=[1, 2, 4, 8])
    parser.add_argument("--parallel", type=lambda s: [int(x) for x in s.split(",")], default=[1, 8])
    parser.add_argument("--split-batch", type=lambda s: [int(x) for x in s.split(",")], default=[1, 8],
                        help="split: --split-batch of each chain")
    parser.add_argument("--shape", choices=["even", "first-heavy", "free"], default="even",
                        help="split: the chain the nodes' --max-memory leaves (free: the planner's choice)")
    parser.add_argument("--requests", type=int, default=3, help="slots, split: requests per stream")
    parser.add_argument("--threads", type=int, default=1, help="slots, split: threads per node")
    parser.add_argument("--clients", type=int, default=32, help="mesh: streaming clients")
    parser.add_argument("--duration", type=float, default=60.0, help="mesh: seconds")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--runs", type=int, default=4, help="steps: processes per kernel choice")
    parser.add_argument("--kernels", choices=["exact", "fast"], default="exact", help=argparse.SUPPRESS)
    parser.add_argument("--path", default="", help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    if args.mode == "steps-child":
        print(json.dumps(steps_child(args.path, args.kernels, args.threads)))
        return
    out = args.out or Path(__file__).parent / "results" / f"load-{args.mode}.json"
    with tempfile.TemporaryDirectory() as tmp:
        spec = str(write_tiny_llama(Path(tmp) / "tiny.gguf", seed=0)) if args.model == "tiny" else "default"
        model = "tiny" if args.model == "tiny" else resolve_model("default", progress=False).model_id
        run = {"slots": bench_slots, "split": bench_split, "mesh": bench_mesh, "steps": bench_steps}[args.mode]
        result = run(args, spec, model, Path(tmp))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({
        "bench": f"load-{args.mode}", "when": datetime.now(UTC).isoformat(timespec="seconds"),
        "host": platform.node(), "cpus": os.cpu_count(), "load_avg": os.getloadavg(), "model": model,
        "args": {k: v for k, v in vars(args).items() if k != "out"}, "results": result}, indent=2, default=str))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
