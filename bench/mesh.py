"""Membership timings on real nodes (CLI subprocesses on 127.0.0.1), medians of several runs.

For each run: start N nodes (one owner, the rest joining), then measure
  converge  - last node ready -> every node lists all others alive with RTTs and a full RTT matrix
  kill      - kill -9 of one node -> no survivor lists it any more          (target < 5 s)
  leave     - SIGTERM of one node (graceful leave) -> no node lists it       (target < 1 s)

    .venv/bin/python bench/mesh.py [--nodes 5] [--runs 5] [--out bench/results/mesh.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from nodes import NodeProcess, running_nodes, wait_until


def sees(node: NodeProcess, other: NodeProcess) -> bool:
    return any(p["node_id"] == other.node_id and p["state"] in ("alive", "suspect") for p in node.status()["peers"])


def full_view(node: NodeProcess, nodes: list[NodeProcess]) -> bool:
    status = node.status()
    alive = {p["node_id"] for p in status["peers"] if p["state"] == "alive" and p["rtt_ms"] is not None}
    ids = {n.node_id for n in nodes}
    matrix = status["rtt_matrix"]
    return alive == ids - {node.node_id} and all(set(matrix.get(a, {})) >= ids - {a} for a in ids)


def one_run(n: int, base: Path) -> dict[str, float]:
    with running_nodes() as nodes:
        nodes.append(NodeProcess(base / "n0", ["--client"], "n0"))
        token = nodes[0].wait_ready()["invite"]
        for i in range(1, n):
            nodes.append(NodeProcess(base / f"n{i}", ["--client", "--member", "--join", token], f"n{i}"))
        for node in nodes:
            node.wait_ready()
        converge = wait_until(lambda: all(full_view(x, nodes) for x in nodes), 30.0, interval=0.02)
        victim, leaver = nodes[1], nodes[2]
        victim.kill()
        survivors = [x for x in nodes if x is not victim]
        kill = wait_until(lambda: not any(sees(x, victim) for x in survivors), 30.0, interval=0.02)
        leaver.proc.send_signal(15)
        remaining = [x for x in survivors if x is not leaver]
        leave = wait_until(lambda: not any(sees(x, leaver) for x in remaining), 30.0, interval=0.02)
        return {"converge_s": converge, "kill_s": kill, "leave_s": leave}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", type=int, default=5)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--out", type=Path, default=Path("bench/results/mesh.json"))
    args = parser.parse_args()
    runs = []
    for i in range(args.runs):
        with tempfile.TemporaryDirectory() as tmp:
            runs.append(one_run(args.nodes, Path(tmp)))
        print(f"run {i + 1}: " + "  ".join(f"{k} {v:.2f}" for k, v in runs[-1].items()), file=sys.stderr)
    rows = []
    for key, target in (("converge_s", 3.0), ("kill_s", 5.0), ("leave_s", 1.0)):
        values = [r[key] for r in runs]
        rows.append({"metric": key, "median": statistics.median(values), "min": min(values), "max": max(values),
                     "target": target})
    print(f"\n{args.nodes} nodes, {args.runs} runs ({time.strftime('%Y-%m-%d')})")
    print(f"| {'metric':<11} | {'median s':>8} | {'min s':>6} | {'max s':>6} | {'target s':>8} |")
    print(f"|{'-' * 13}|{'-' * 9}:|{'-' * 7}:|{'-' * 7}:|{'-' * 9}:|")
    for r in rows:
        print(f"| {r['metric']:<11} | {r['median']:>8.2f} | {r['min']:>6.2f} | {r['max']:>6.2f} "
              f"| {r['target']:>8.1f} |")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"nodes": args.nodes, "runs": runs, "summary": rows}, indent=2))


if __name__ == "__main__":
    main()
