"""What an idle member costs by mesh size (real ``meshllm serve`` processes on 127.0.0.1).

For each size N: an owner serving the tiny model and N - 1 ``--client --member`` joiners; once
every member lists all the others and the records have settled, each member's CPU (user + system
from /proc) and stream bytes by kind (its ``/metrics``) are measured over ``--window`` seconds.
Sizes run one after another, ``--runs`` times interleaved; the table gives medians over members
and runs. An idle mesh should cost each member little, and that cost should not grow with N (the
connections are bounded by the partial view).

    .venv/bin/python bench/mesh_idle.py [--sizes 4 10 20] [--runs 2] [--window 30]

Writes bench/results/mesh_idle.json. Figures in docs/benchmarks.md.
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
from passive_clients import window
from tinymodels import write_tiny_llama

SETTLE_S = 10.0
"""After the views are full: first RTTs into the records, the partial views drawn."""


def measure(size: int, seconds: float) -> list[dict[str, float]]:
    """Per member of an idle mesh of ``size``: CPU % of one core and bytes/s by stream kind."""
    with tempfile.TemporaryDirectory() as tmp, running_nodes() as nodes:
        base = Path(tmp)
        model = write_tiny_llama(base / "tiny.gguf", seed=1)
        owner = NodeProcess(base / "m0", ["--model", str(model), "--threads", "1"], "m0")
        nodes.append(owner)
        token = owner.wait_ready(120)["invite"]
        for i in range(1, size):
            nodes.append(NodeProcess(base / f"m{i}", ["--client", "--member", "--join", token], f"m{i}"))
        for node in nodes:
            node.wait_ready(120)
        wait_until(lambda: all(len(n.status()["peers"]) == size - 1 for n in nodes), 120)
        time.sleep(SETTLE_S)
        return window(nodes, seconds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=int, nargs="+", default=[4, 10, 20])
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--window", type=float, default=30.0)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "mesh_idle.json")
    args = parser.parse_args()
    rows: dict[int, list[dict[str, float]]] = {n: [] for n in args.sizes}
    for _ in range(args.runs):
        for size in args.sizes:
            rows[size] += measure(size, args.window)
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
