"""A split chain's formation and rebuild over real nodes: time to serve, and the gap a worker's death leaves.

Real ``meshllm serve`` processes: a coordinator holding the model (``--split force --stages 3``) and two
``--worker``s with empty homes, all ``--threads 1``. Measured per round, in a fresh mesh:

- **serve_s**: from starting the coordinator's process to its first completed ``/v1/completions``
  (workers are started as soon as its invite exists; their stages' layers travel from it);
- a greedy stream of ``--tokens`` tokens uninterrupted (the reference), then the same stream with the
  **last stage's worker killed** (``kill -9``) after ``--kill-at`` chunks: the longest gap between two
  chunks, whether the text is exactly the reference's, and whether the rebuilt chain fetched any bytes
  (``split_stage_fetched`` after the kill; none when a warm spare held them). The kill waits until the
  coordinator has placed its warm spares (``split_spares_ready``); with ``--no-spares`` the coordinator
  keeps none (``--no-split-spares``), so the rebuilt stage fetches its layers: the JSON then has that
  fetch's bytes and seconds (the survivor's ``transfer_done``) beside the gap.

    .venv/bin/python bench/rebuild.py [--model default|gemma|PATH] [--rounds 1] [--tokens 64] [--kill-at 16]
                                      [--no-spares]
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from nodes import NodeProcess, running_nodes, wait_until

ARGS = ["--threads", "1"]


def stream(http: httpx.Client, node: NodeProcess, model: str, tokens: int,
           kill: tuple[int, NodeProcess] | None) -> tuple[str, list[float]]:
    body = {"model": model, "prompt": "The history of the city of Paris", "max_tokens": tokens, "temperature": 0,
            "stream": True}
    times, text = [time.perf_counter()], ""
    with http.stream("POST", f"{node.api}/v1/completions", json=body, timeout=120) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(f"the stream failed: {chunk['error']}")
            times.append(time.perf_counter())
            text += chunk["choices"][0]["text"] if chunk.get("choices") else ""
            if kill is not None and len(times) == kill[0]:
                KILLED.append(time.time())
                kill[1].kill()
    return text, [b - a for a, b in itertools.pairwise(times[1:])]


KILLED: list[float] = []
"""Wall-clock time of each kill (events carry wall-clock ``ts``)."""


def after_kill(node: NodeProcess, kind: str) -> float:
    """Seconds from the kill to ``node``'s first ``kind`` event after it (nan: none)."""
    ts = next((e["ts"] for e in node.events if e["type"] == kind and e["ts"] >= KILLED[-1]), None)
    return float("nan") if ts is None else ts - KILLED[-1]


def one_round(http: httpx.Client, spec: str, tokens: int, kill_at: int, spares: bool = True) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp, running_nodes() as nodes:
        root = Path(tmp)
        started = time.perf_counter()
        wall = time.time()
        model_args = [] if spec == "default" else ["--model", spec]
        coord = NodeProcess(root / "c", [*model_args, "--split", "force", "--stages", "3", *ARGS,
                                         *([] if spares else ["--no-split-spares"])], "coord")
        nodes.append(coord)
        token = coord.wait_ready(120)["invite"]
        workers = [NodeProcess(root / f"w{i}", ["--worker", "--join", token, *ARGS], f"w{i}") for i in (1, 2)]
        nodes += workers
        ready = coord.wait_event(lambda e: e["type"] == "split_ready", 120)
        model = coord.status()["splits"][0]["model"]
        body = {"model": model, "prompt": "Hi", "max_tokens": 1, "temperature": 0}
        wait_until(lambda: http.post(f"{coord.api}/v1/completions", json=body, timeout=60).status_code == 200,
                   120, interval=0.05)
        serve_s = time.perf_counter() - started
        coord_ready_s = next(e["ts"] for e in coord.events if e["type"] == "ready") - wall
        split_ready_s = ready["ts"] - wall
        try:
            spare = coord.wait_event(lambda e: e["type"] == "split_spares_ready", 60) if spares else \
                {"spares": [], "failed": []}
        except AssertionError:
            print([e for e in coord.events if e["type"].startswith(("split", "transfer"))], file=sys.stderr)
            raise
        reference, ref_gaps = stream(http, coord, model, tokens, None)
        fetched_before = sum(e["type"] == "split_stage_fetched" for e in coord.events)
        stages = coord.status()["splits"][0]["stages"]  # the chain now (a loaded host may have rebuilt it)
        last = next(w for w in workers if w.name == stages[-1]["name"])
        try:
            text, gaps = stream(http, coord, model, tokens, (kill_at, last))
        except RuntimeError as exc:  # the rebuild failed: reported as such, left out of the medians
            return {"serve_s": serve_s, "error": str(exc), "spares": spare["spares"]}
        fetched_after = [e for e in coord.events if e["type"] == "split_stage_fetched"][fetched_before:]
        survivor = next(w for w in workers if w is not last)
        refetch = [e for e in survivor.events if e["type"] == "transfer_done" and e["ts"] >= KILLED[-1]]
        try:
            rebuilt = coord.wait_event(lambda e: e["type"] == "split_replayed" and e["ts"] >= KILLED[-1], 30)
        except AssertionError:
            return {"serve_s": serve_s, "error": f"no replay after killing {last.name} (chain {stages})",
                    "spares": spare["spares"]}
        return {"serve_s": serve_s, "coord_ready_s": coord_ready_s, "split_ready_s": split_ready_s,
                "split_ready_took_s": ready["took_s"], "max_gap_s": max(gaps),
                "failed_s": after_kill(coord, "split_stage_failed"), "rebuilt_s": after_kill(coord, "split_ready"),
                "replay_wait_ms": rebuilt["took_ms"],
                "ref_max_gap_s": max(ref_gaps), "ref_median_gap_s": statistics.median(ref_gaps),
                "exact": text == reference, "rebuild_fetched_bytes": sum(e["bytes"] for e in fetched_after),
                "rebuild_fetch_s": sum(e["took_s"] for e in refetch),
                "rebuild_fetch_mb": sum(e["bytes"] for e in refetch) / 1e6,
                "spares": spare["spares"], "spares_failed": spare["failed"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="default", help="default, or a GGUF path")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--kill-at", type=int, default=16)
    parser.add_argument("--no-spares", action="store_true", help="the coordinator keeps no warm spares")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "rebuild.json")
    args = parser.parse_args()
    with httpx.Client(trust_env=False) as http:
        runs = [one_round(http, args.model, args.tokens, args.kill_at, not args.no_spares) for _ in range(args.rounds)]
    keys = ("serve_s", "coord_ready_s", "split_ready_s", "split_ready_took_s", "ref_median_gap_s", "ref_max_gap_s",
            "max_gap_s", "failed_s", "rebuilt_s", "replay_wait_ms", "rebuild_fetched_bytes", "rebuild_fetch_s")
    good = [r for r in runs if "error" not in r]
    for r in runs:
        if "error" in r:
            print(f"a round failed: {r['error']}")
    med = {k: statistics.median(r[k] for r in good) for k in keys}
    print(f"model {args.model}, 3 stages (coordinator + 2 workers), {args.tokens} greedy tokens, last worker killed "
          f"after {args.kill_at} chunks, {'no' if args.no_spares else 'warm'} spares; {args.rounds} round(s), medians; "
          f"load average {os.getloadavg()[0]:.2f}")
    print("serve s = coordinator ready s + ... + split_ready s (placement took s) + first completion")
    print(f"  {med['serve_s']:.2f} = {med['coord_ready_s']:.2f} + ... + {med['split_ready_s']:.2f} "
          f"({med['split_ready_took_s']:.2f}) + {med['serve_s'] - med['split_ready_s']:.2f}")
    print("| token ms | ref max gap s | killed max gap s | failure seen s | chain rebuilt s | replay wait ms "
          "| rebuild fetched MB | its fetch s | exact |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    print(f"| {med['ref_median_gap_s'] * 1e3:.1f} | {med['ref_max_gap_s']:.3f} | {med['max_gap_s']:.3f} | "
          f"{med['failed_s']:.3f} | {med['rebuilt_s']:.3f} | {med['replay_wait_ms']:.0f} | "
          f"{med['rebuild_fetched_bytes'] / 1e6:.1f} | {med['rebuild_fetch_s']:.2f} "
          f"| {'yes' if all(r['exact'] for r in good) else 'NO'} "
          f"| ({len(good)} of {len(runs)} rounds rebuilt)")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"date": datetime.date.today().isoformat(), "model": args.model,
                                    "spares": not args.no_spares, "load_average": os.getloadavg(),
                                    "tokens": args.tokens, "kill_at": args.kill_at, "medians": med, "runs": runs},
                                   indent=2))


if __name__ == "__main__":
    main()
