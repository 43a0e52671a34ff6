"""What an idle member costs by mesh size (real ``meshllm serve`` processes on 127.0.0.1).

For each size N: an owner serving the tiny model and N - 1 ``--client --member`` joiners; once
every member lists all the others and the records have settled, each member's CPU (user + system
from /proc) and stream bytes by kind (its ``/metrics``) are measured over ``--window`` seconds.
Sizes run one after another, ``--runs`` times interleaved; the table gives medians over members
and runs. An idle mesh should cost each member little, and that cost should not grow with N (the
connections are bounded by the partial view).

    .venv/bin/python bench/mesh_idle.py [--sizes 4 10 20] [--runs 2] [--window 30] [--batch 8]

Writes bench/results/mesh_idle.json. Figures in docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import httpx
from nodes import NodeProcess, running_nodes, wait_until
from tinymodels import write_tiny_llama

SETTLE_S = 10.0
"""After the views are full: first RTTs into the records, the partial views drawn."""
TICK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK


def stream_bytes(node: NodeProcess) -> dict[str, float]:
    """``{kind: sent + received}`` from the node's /metrics."""
    text = httpx.get(node.api + "/metrics", headers=node.admin_headers, timeout=10).text
    out: dict[str, float] = {}
    for m in re.finditer(r'^meshllm_stream_bytes_total\{([^}]*)\} ([0-9.e+]+)$', text, re.M):
        kind = re.search(r'kind="([^"]*)"', m.group(1))
        key = kind.group(1) if kind else ""
        out[key] = out.get(key, 0.0) + float(m.group(2))
    return out


def window(members: list[NodeProcess], seconds: float) -> list[dict[str, float]]:
    """Per member: CPU % of one core, and bytes/s of gossip, route tables and all streams, over ``seconds``."""
    cpu0 = [cpu_seconds(m.proc.pid) for m in members]
    bytes0 = [stream_bytes(m) for m in members]
    t0 = time.monotonic()
    time.sleep(seconds)
    elapsed = time.monotonic() - t0
    cpu1 = [cpu_seconds(m.proc.pid) for m in members]
    bytes1 = [stream_bytes(m) for m in members]
    rows = []
    for c0, c1, b0, b1 in zip(cpu0, cpu1, bytes0, bytes1, strict=True):
        delta = {k: b1.get(k, 0.0) - b0.get(k, 0.0) for k in b1.keys() | b0.keys()}
        rows.append({"cpu_pct": 100 * (c1 - c0) / elapsed, "gossip_Bps": delta.get("gossip", 0.0) / elapsed,
                     "routes_Bps": delta.get("routes", 0.0) / elapsed, "all_Bps": sum(delta.values()) / elapsed})
    return rows


def start_members(base: Path, nodes: list[NodeProcess], size: int, profiled: Sequence[str] | None = None,
                  batch: int = 0) -> str:
    """An owner serving the tiny model and ``size - 1`` ``--client --member`` joiners, appended to
    ``nodes``, up and settled (every member lists every other one); returns the owner's invite.
    ``profiled``: what Python runs for member m1 instead of ``-m meshllm`` (a profiler). ``batch``: start
    the joiners that many at a time, each batch once the one before is ready (0: all at once)."""
    model = write_tiny_llama(base / "tiny.gguf", seed=1)
    owner = NodeProcess(base / "m0", ["--model", str(model), "--threads", "1"], "m0")
    nodes.append(owner)
    token = owner.wait_ready(120)["invite"]
    step = batch or size
    for first in range(1, size, step):
        for i in range(first, min(size, first + step)):
            entry = profiled if profiled is not None and i == 1 else ("-m", "meshllm")
            nodes.append(NodeProcess(base / f"m{i}", ["--client", "--member", "--join", token], f"m{i}", entry=entry))
        for node in nodes:
            node.wait_ready(120)
    wait_until(lambda: all(len(n.status()["peers"]) == size - 1 for n in nodes), 120)
    time.sleep(SETTLE_S)
    return token


def measure(size: int, seconds: float, batch: int = 0) -> list[dict[str, float]]:
    """Per member of an idle mesh of ``size``: CPU % of one core and bytes/s by stream kind."""
    with tempfile.TemporaryDirectory() as tmp, running_nodes() as nodes:
        start_members(Path(tmp), nodes, size, batch=batch)
        return window(nodes, seconds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=int, nargs="+", default=[4, 10, 20])
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--window", type=float, default=30.0)
    parser.add_argument("--batch", type=int, default=0, help="start joiners this many at a time (0: all at once)")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "mesh_idle.json")
    args = parser.parse_args()
    rows: dict[int, list[dict[str, float]]] = {n: [] for n in args.sizes}
    for _ in range(args.runs):
        for size in args.sizes:
            rows[size] += measure(size, args.window, args.batch)
    print(f"{'members':>7} {'CPU % median':>12} {'CPU % max':>9} {'gossip B/s median':>17} "
          f"{'all streams B/s median':>22}")
    result = []
    for size, members in rows.items():
        med = {k: statistics.median(r[k] for r in members) for k in ("cpu_pct", "gossip_Bps", "all_Bps")}
        top = max(r["cpu_pct"] for r in members)
        print(f"{size:>7} {med['cpu_pct']:>12.2f} {top:>9.2f} {med['gossip_Bps']:>17.0f} {med['all_Bps']:>22.0f}")
        result.append({"members": size, "median": med, "cpu_pct_max": top, "per_member": members})
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"window_s": args.window, "runs": args.runs, "sizes": result}, indent=2))


if __name__ == "__main__":
    main()
