"""The gap a client sees when the node serving its stream is killed: uninterrupted vs ``kill -9`` + replay.

Real nodes: two nodes serve the model, a ``--client`` node C routes. For each kill point
``k`` the same greedy 200-token stream is read from C twice, back to back: once uninterrupted (the
reference), once with the serving node killed (``kill -9``) after ``k`` chunks. The router replays the
request on another node, which decodes the ``k``-odd tokens already sent one per step (that is what
keeps the text exact) and continues. Each kill runs in a fresh mesh of two servers and C; the node
killed is the one serving the stream (found by its ``served_for_peers`` count).

Reported per kill point (medians over rounds): the longest gap between two chunks uninterrupted and
with the kill, their ratio, the replay's own share (from the failure to the replacement's first
event, the ``request_replayed`` event's ``took_ms``), the rest (the kill noticed: the transport's
probes), and whether the text was exactly the reference's.

    .venv/bin/python bench/replay.py [--model default|PATH] [--kill-at 10 50 100] [--rounds 1] [--out PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
import itertools

from nodes import NodeProcess, running_nodes, wait_until

from meshllm.models.refs import model_id_for, resolve_model

MAX_TOKENS = 200
THREADS = 1
PROMPT = "The history of the printing press begins in the fifteenth century, when"


def served(nodes: list[NodeProcess]) -> list[int]:
    """Requests each node has served for peers so far."""
    return [n.status()["requests"]["served_for_peers"] for n in nodes]


def stream(http: httpx.Client, c: NodeProcess, model: str, user: str, servers: list[NodeProcess] | None,
           kill_at: int) -> tuple[str, list[float], NodeProcess | None]:
    """Read one greedy stream from C, killing the node serving it (one of ``servers``) after ``kill_at``
    chunks: text, gaps between chunks, the node killed."""
    before = served(servers) if servers else []
    victim = None
    body = {"model": model, "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0, "stream": True,
            "user": user}
    text, times = "", []
    with http.stream("POST", f"{c.api}/v1/completions", json=body, timeout=120) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(f"the stream failed: {chunk['error']}")
            times.append(time.perf_counter())
            text += chunk["choices"][0]["text"] if chunk.get("choices") else ""
            if servers and len(times) == kill_at:
                victim = next(n for n, b, a in zip(servers, before, served(servers), strict=True) if a > b)
                victim.kill()
    return text, [b - a for a, b in itertools.pairwise(times)], victim


def one_kill(http: httpx.Client, spec: str, model: str, k: int, user: str) -> dict[str, Any]:
    """A fresh mesh (two servers, client C): the reference stream, then the stream whose server is killed.

    A fresh mesh per kill, because after a kill the surviving accuser's down notices get it cut off
    by the others for a minute (``peer_cooled``: "down notices faster than any honest accuser signs
    them"), which would leave a second replay nowhere to go.
    """
    with tempfile.TemporaryDirectory() as tmp, running_nodes() as nodes:
        first = NodeProcess(Path(tmp) / "s0", ["--model", spec, "--threads", str(THREADS)], "s0")
        nodes.append(first)
        token = first.wait_ready(120)["invite"]
        second = NodeProcess(Path(tmp) / "s1", ["--model", spec, "--threads", str(THREADS), "--join", token], "s1")
        c = NodeProcess(Path(tmp) / "c", ["--client", "--join", token], "c")
        nodes.extend([second, c])
        for node in (second, c):
            node.wait_ready(120)
        wait_until(lambda: len(next((m["nodes"] for m in httpx.get(f"{c.api}/v1/models", timeout=5).json()["data"]
                                     if m["id"] == model), [])) == 2, 60)
        reference, ref_gaps, _ = stream(http, c, model, user, None, k)
        text, gaps, victim = stream(http, c, model, user, [first, second], k)
        assert victim is not None
        replayed = c.wait_event(lambda e: e["type"] == "request_replayed", 10)
        return {"exact": text == reference, "tokens_replayed": replayed["tokens"],
                "replay_ms": replayed["took_ms"], "max_gap_ms": max(gaps) * 1000,
                "ref_max_gap_ms": max(ref_gaps) * 1000, "ref_median_gap_ms": statistics.median(ref_gaps) * 1000}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="default", help="default, or a GGUF path")
    parser.add_argument("--kill-at", type=int, nargs="+", default=[10, 50, 100])
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "replay.json")
    args = parser.parse_args()

    spec = args.model
    model = resolve_model(spec, progress=False).model_id if spec == "default" else model_id_for(Path(spec))
    runs: dict[int, list[dict[str, Any]]] = {k: [] for k in args.kill_at}
    with httpx.Client(trust_env=False) as http:
        for rnd in range(args.rounds):
            for k in args.kill_at:
                runs[k].append(one_kill(http, spec, model, k, f"bench-{rnd}-{k}"))

    rows = {}
    for k, samples in runs.items():
        med = {key: statistics.median(s[key] for s in samples)
               for key in ("tokens_replayed", "replay_ms", "max_gap_ms", "ref_max_gap_ms", "ref_median_gap_ms")}
        rows[k] = {**med, "gap_ratio": med["max_gap_ms"] / med["ref_max_gap_ms"],
                   "noticed_ms": med["max_gap_ms"] - med["replay_ms"], "exact": all(s["exact"] for s in samples),
                   "runs": len(samples)}
    print(f"model {model}, {MAX_TOKENS} greedy tokens, kill -9 of the serving node after k chunks, "
          f"{args.rounds} round(s), medians; load average {os.getloadavg()[0]:.2f}")
    print(f"{'k':>4} {'replayed':>9} {'token ms':>9} {'max gap ms':>11} {'killed gap ms':>14} {'ratio':>6} "
          f"{'replay ms':>10} {'noticed ms':>11} {'exact':>6}")
    for k, r in rows.items():
        print(f"{k:4d} {r['tokens_replayed']:9.0f} {r['ref_median_gap_ms']:9.1f} {r['ref_max_gap_ms']:11.0f} "
              f"{r['max_gap_ms']:14.0f} {r['gap_ratio']:6.1f} {r['replay_ms']:10.0f} {r['noticed_ms']:11.0f} "
              f"{'yes' if r['exact'] else 'NO':>6}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({
        "bench": "replay", "when": datetime.now(UTC).isoformat(timespec="seconds"), "host": platform.node(),
        "cpus": os.cpu_count(), "model": model, "max_tokens": MAX_TOKENS, "results": rows, "samples": runs},
        indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
