"""Gossip and failure detection at 10 to 10,000 nodes on a simulated network.

Runs the real ``meshllm.mesh`` cores (real Ed25519 records; verification of identical bytes is
cached across simulated nodes) on the discrete-event network of ``tests/mesh/sim.py``: simulated
clock, per-link latency 2-40 ms RTT, 1% loss. Each size starts converged, then measures:

- **change**: one node updates its record; rounds and simulated seconds until every node holds it;
- **kill**: one node crashes; seconds until it is gone from every live node's view;
- **bytes/node/s**: all gossip and probe traffic over the run, per node per simulated second
  (refreshes have a random phase, so the run sees their steady rate), and its split by message;
- **view memory**: the bytes one node's table of every peer takes (its own copy, records included:
  the simulation itself shares one table between nodes).

Usage: ``python bench/gossip_sim.py [--sizes 10 100 1000] [--out bench/results/gossip_sim.json]``
(``--sizes 10000``: about 7 minutes of CPU and 1.1 GB here; 1,000 nodes take about 8 s.)
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import tracemalloc
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "mesh"))

from sim import SimNet  # noqa: E402

from meshllm.mesh import view  # noqa: E402
from meshllm.mesh.records import Load, decode_record  # noqa: E402


def view_bytes(net: SimNet) -> int:
    """Bytes of a private copy of one node's table (fresh record objects and bytes, no sharing)."""
    table = next(iter(net.nodes.values())).gossip.state.peers
    raws = [bytes(entry.raw) + b"" for entry in table.values()]
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    copy = view.Table.of({
        (rec := decode_record(raw)[1]).node_id: view.PeerEntry(rec, raw, "alive", 0.0, 0.0) for raw in raws})
    used = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    del copy
    return used + sum(len(raw) + 33 for raw in raws)  # the raw bytes were copied before tracing


def run(n: int, seed: int, loss: float) -> dict[str, float]:
    """One size: warm up, propagate a change, kill a node; returns the measured figures."""
    wall = time.perf_counter()
    net = SimNet(n, seed=seed, loss=loss, preseed=True)
    net.run_until(2.0)
    changer, victim = net.ids[1], net.ids[2]

    start = net.now
    net.nodes[changer].gossip.update_own(start, load=Load(in_flight=1))
    target = net.nodes[changer].gossip.own.seq
    reached: dict[str, float] = {changer: start}

    def holds(node_id: str) -> bool:
        entry = net.nodes[node_id].gossip.state.peers.get(changer)
        return entry is not None and entry.record.seq >= target

    def on_event(node: object, event: object) -> None:
        if isinstance(event, view.RecordUpdated) and event.node_id == changer and holds(node.id):  # type: ignore[attr-defined]
            reached.setdefault(node.id, net.now)  # type: ignore[attr-defined]
        if isinstance(event, view.PeerRemoved) and event.node_id == victim:
            removed.setdefault(node.id, net.now)  # type: ignore[attr-defined]

    removed: dict[str, float] = {}
    net.observers.append(on_event)
    net.run_until(start + 120.0, stop=lambda: len(reached) == n)
    converge_s = max(reached.values()) - start if len(reached) == n else float("inf")
    interval = net.nodes[changer].gossip.interval()

    kill_at = net.now
    net.kill(victim)
    live = {node.id for node in net.live()}
    net.run_until(kill_at + 60.0, stop=lambda: live <= removed.keys())
    detect_s = max(removed.values()) - kill_at if live <= removed.keys() else float("inf")
    net.run_until(net.now + 1.0)

    sim_s = net.now
    view_b = view_bytes(net)
    node = net.nodes[changer].gossip
    return {
        "nodes": n,
        "converge_rounds": round(converge_s / interval, 2),
        "converge_s": round(converge_s, 3),
        "detect_kill_s": round(detect_s, 3),
        "first_removal_s": round(min(removed.values(), default=float("inf")) - kill_at, 3),
        "bytes_per_node_s": round(sum(net.bytes_sent.values()) / n / sim_s),
        "connections_mean": round(sum(len(x.gossip.connected) for x in net.live()) / len(live), 1),
        "round_interval_s": round(interval, 2),
        "refresh_s": round(node.refresh_period(), 1),
        "record_bytes": len(node.own_raw),
        "view_bytes_per_node": view_b,
        "bytes_by_message": {k: round(v / n / sim_s) for k, v in sorted(net.bytes_by_kind.items())},
        "simulated_s": round(sim_s, 2),
        "wall_s": round(time.perf_counter() - wall, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[10, 100, 1000])
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--loss", type=float, default=0.01)
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "gossip_sim.json")
    args = parser.parse_args()
    rows = [run(n, args.seed, args.loss) for n in args.sizes]
    cols = [c for c in rows[0] if c != "bytes_by_message"]
    print("| " + " | ".join(cols) + " |")
    print("|" + "---|" * len(cols))
    for row in rows:
        print("| " + " | ".join(str(row[c]) for c in cols) + " |")
    for row in rows:
        print(f"{row['nodes']} nodes, bytes/node/s by message: {row['bytes_by_message']}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"loss": args.loss, "seed": args.seed, "runs": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
