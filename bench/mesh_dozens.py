"""A real mesh of dozens: N ``meshllm serve`` processes on 127.0.0.1 under churn (tests/churn.py does the work).

10 % of the members are killed (``kill -9``) and restarted one after another over ``--duration``
seconds, serving nodes among them, while chat threads stream through random nodes that are never
killed (members that serve nothing and passive clients). Reports: chats completed and failed
(a chat whose serving node died must finish through failover or replay), how long after the last
restart every survivor's view held exactly the live members (target <= 5 s; dated from the views'
own ``state_s``, with "seen": when a sweep of all 50 status calls saw it), the passive clients'
convergence (the same two figures, also from the last restart), per-node RSS and gossip bytes/s, and
the false downs: every verdict against a member that was alive, by whom, and how long that accuser had
heard nothing from it.

    .venv/bin/python bench/mesh_dozens.py [--nodes 50] [--serving 4] [--workers 10] [--passive 4] [--duration 120]

Writes bench/results/mesh_dozens.json. Figures in docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from churn import run_churn


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", type=int, default=50, help="members (gossip), the owner included")
    parser.add_argument("--serving", type=int, default=4, help="members serving the tiny model (the owner is one)")
    parser.add_argument("--workers", type=int, default=10, help="--worker members (the rest are --client --member)")
    parser.add_argument("--passive", type=int, default=4, help="passive clients (entry points, not members)")
    parser.add_argument("--duration", type=float, default=120.0, help="seconds to kill and restart 10 %% over")
    parser.add_argument("--threads", type=int, default=2, help="chat threads")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "mesh_dozens.json")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        result = run_churn(Path(tmp), nodes=args.nodes, serving=args.serving, workers=args.workers,
                           passive=args.passive, duration=args.duration, chat_threads=args.threads,
                           settle_timeout=300.0)
    print(f"{result['nodes']} members ({result['serving']} serving, {result['workers']} workers) + "
          f"{result['passive']} passive clients, started in {result['started_s']} s; killed and restarted: "
          f"{', '.join(result['victims'])} over {result['duration_s']:g} s")
    print(f"{'chats ok':>8} {'failed':>6} {'replays':>7} {'converged after last restart (seen)':>35} "
          f"{'passive (seen)':>15} {'RSS MB median':>13} {'RSS MB max':>10} {'gossip B/s median':>17} "
          f"{'gossip B/s max':>14}")
    converge = f"{result['converge_after_last_restart_s']:.2f} s ({result['converge_seen_s']:.2f} s)"
    passive = f"{result['passive_converge_s']:.2f} s ({result['passive_seen_s']:.2f} s)"
    print(f"{result['chats_ok']:>8} {len(result['chats_failed']):>6} {result['replays']:>7} {converge:>35} "
          f"{passive:>15} {result['rss_mb_median']:>13.1f} {result['rss_mb_max']:>10.1f} "
          f"{result['gossip_Bps_median']:>17} {result['gossip_Bps_max']:>14}")
    print("latest changes in the members' views:", "; ".join(result["latest_changes"]))
    print("latest changes in the passive clients' views:", "; ".join(result["passive_latest_changes"]))
    verdicts = result["false_down_verdicts"]
    print(f"false downs (live members declared down, seconds from the last restart): {len(verdicts)} verdicts, "
          f"{result['false_down_views']} views dropped a live member for a while")
    for verdict in verdicts:
        print("  ", verdict)
    for failure in result["chats_failed"][:5]:
        print("failed:", failure)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
