"""What passive clients cost the members they pull route tables from (real nodes and drivers on 127.0.0.1).

Starts M members (``meshllm serve``: an owner serving the tiny model, the rest ``--client --member``),
measures each member's CPU (user + system seconds from /proc) and stream bytes by kind (its
``/metrics``) over a window, then starts C passive clients (the real :class:`PassiveMesh` driver,
several per process, each with its own key, UDP socket and connections; they join through the
owner's open invite and anchor to a member drawn at random) and measures the same window again, and
once more after the clients are killed: the clients' cost is the window with them against the mean of
the two without.

    .venv/bin/python bench/passive_clients.py [--members 3] [--clients 200] [--procs 4] [--window 60]

Prints a table (per member: CPU % of one core before/after, gossip and route-table bytes/s) and
writes bench/results/passive_clients.json. Figures in docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from mesh_idle import cpu_seconds, start_members, window
from nodes import running_nodes

from meshllm.mesh.passive import IDLE_CLOSE_S
from meshllm.mesh.routes import ANCHORS, PULL_INTERVAL_S

# -- the client swarm (runs in its own processes) ------------------------------------------------------


async def swarm(token: str, anchors: list[str], count: int, interval: float, seed: int) -> None:
    """``count`` passive clients in this process; prints ``ready N`` once all pulled a table, then runs."""
    from meshllm.identity.keys import NodeKey
    from meshllm.mesh.membership import join_mesh
    from meshllm.mesh.passive import PassiveMesh
    from meshllm.mesh.records import PeerRecord

    rng = random.Random(seed)
    meshes = []
    for i in range(count):
        key = NodeKey.ephemeral()
        membership = join_mesh(key.signing_key, token, time.time())
        membership.bootstrap = [anchors[0]]  # the owner grants (its grants count against no quota) ...
        record = PeerRecord(node_id=key.node_id, mesh_id=membership.mesh_id, seq=0,
                            membership_proof=membership.proof, role="client", name=f"swarm{seed}-{i}")
        mesh = PassiveMesh(key, membership, record, check_trust=lambda *_: None, on_event=lambda *_a, **_k: None,
                           host="127.0.0.1", port=0, interval=interval, rng=random.Random(rng.random()))
        await mesh.start()
        meshes.append(mesh)
    # ... and each client then anchors to a member drawn at random from its table
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not all(len(m.anchors) >= min(ANCHORS, len(anchors)) for m in meshes):
        await asyncio.sleep(0.2)
    counts = [len(m.anchors) for m in meshes]
    print(f"ready {len(meshes)} clients holding {' '.join(f'{n} anchors: {counts.count(n)}' for n in set(counts))}",
          flush=True)
    await asyncio.Event().wait()


def start_swarm(token: str, anchors: list[str], count: int, interval: float, seed: int) -> subprocess.Popen[str]:
    cmd = [sys.executable, __file__, "--swarm", token, "--anchors", ",".join(anchors), "--clients", str(count),
           "--interval", str(interval), "--seed", str(seed)]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)


def run(members_n: int, clients: int, procs: int, seconds: float, interval: float,
        profile: Path | None = None) -> dict[str, object]:
    with tempfile.TemporaryDirectory() as tmp, running_nodes() as nodes:
        base = Path(tmp)
        profiled = ("-m", "cProfile", "-o", str(profile), "-m", "meshllm") if profile is not None else None
        token = start_members(base, nodes, members_n, profiled)
        before = window(nodes, seconds)
        anchors = [n.mesh_addr for n in nodes]
        swarms = [start_swarm(token, anchors, clients // procs + (i < clients % procs), interval, i)
                  for i in range(procs)]
        try:
            started = time.monotonic()
            for s in swarms:
                assert s.stdout is not None
                line = s.stdout.readline()
                if not line.startswith("ready"):
                    raise SystemExit(f"a client swarm failed to start: {line!r}")
                print(line.strip(), file=sys.stderr)
            start_s = time.monotonic() - started
            # steady state: the clients that drew another anchor have closed their connection to the
            # invite's member (idle), and every client has pulled at least once from its anchor
            time.sleep(IDLE_CLOSE_S + 5)
            routes0 = [n.status()["route_tables"] for n in nodes]
            after = window(nodes, seconds)
            statuses = [n.status() for n in nodes]
            routes1 = [st["route_tables"] for st in statuses]
            viewed = max(len(st["peers"]) for st in statuses)  # members list members only: never a client
            for row, r0, r1 in zip(after, routes0, routes1, strict=True):
                row["pulls"], row["tables"] = r1["pulls"] - r0["pulls"], r1["tables"] - r0["tables"]
                row["passive_connections"] = r1["passive_connections"]
            swarm_cpu = sum(cpu_seconds(s.pid) for s in swarms)
            for s in swarms:
                s.kill()
                s.wait(10)
            # the host drifts between windows minutes apart (an idle member by 10 % on this one): a window
            # after the clients are gone too brackets the one with them (their connections idle out)
            gone = window(nodes, seconds)
            if profile is not None:
                nodes[1].terminate(60)  # a graceful exit writes the profile (running_nodes kills)
        finally:
            for s in swarms:
                s.kill()
                s.wait(10)
        return {"members": members_n, "clients": clients, "largest_member_view": viewed, "procs": procs,
                "window_s": seconds,
                "interval_s": interval, "clients_start_s": round(start_s, 1), "swarm_cpu_s": round(swarm_cpu, 1),
                "before": before, "after": after, "gone": gone}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--members", type=int, default=3)
    parser.add_argument("--clients", type=int, default=200)
    parser.add_argument("--procs", type=int, default=4, help="processes the clients share")
    parser.add_argument("--window", type=float, default=PULL_INTERVAL_S,
                        help="seconds measured before and after (at least a pull interval: every client pulls)")
    parser.add_argument("--interval", type=float, default=PULL_INTERVAL_S, help="clients' pull interval (the default)")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "passive_clients.json")
    parser.add_argument("--profile", type=Path, help="run member m1 under cProfile, writing its stats here")
    parser.add_argument("--swarm", help=argparse.SUPPRESS)
    parser.add_argument("--anchors", help=argparse.SUPPRESS)
    parser.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.swarm:
        os.nice(19)  # the clients share the members' cores here: let them not delay the members' gossip
        asyncio.run(swarm(args.swarm, args.anchors.split(","), args.clients, args.interval, args.seed))
        return
    result = run(args.members, args.clients, args.procs, args.window, args.interval, args.profile)
    before, after, gone = result["before"], result["after"], result["gone"]
    print(f"{args.members} members, {args.clients} passive clients in {args.procs} processes, pulls every "
          f"{args.interval:g} s, {args.window:g} s windows (clients started in {result['clients_start_s']} s)")
    print(f"{'member':>6} {'cpu% before':>11} {'with':>6} {'gone':>6} {'gossip B/s before':>17} {'with':>6} "
          f"{'gone':>6} {'routes B/s':>10} {'all B/s before':>14} {'with':>6} {'gone':>6} {'clients':>7} "
          f"{'pulls':>5} {'tables':>6}")
    for i, (b, a, g) in enumerate(zip(before, after, gone, strict=True)):  # type: ignore[call-overload]
        print(f"{'m' + str(i):>6} {b['cpu_pct']:>11.2f} {a['cpu_pct']:>6.2f} {g['cpu_pct']:>6.2f} "
              f"{b['gossip_Bps']:>17.0f} {a['gossip_Bps']:>6.0f} {g['gossip_Bps']:>6.0f} {a['routes_Bps']:>10.0f} "
              f"{b['all_Bps']:>14.0f} {a['all_Bps']:>6.0f} {g['all_Bps']:>6.0f} {a['passive_connections']:>7} "
              f"{a['pulls']:>5} {a['tables']:>6}")
    # per member: the window with the clients against the mean of the windows around it
    med = {k: (statistics.median((b[k] + g[k]) / 2 for b, g in zip(before, gone, strict=True)),  # type: ignore[index]
               statistics.median(r[k] for r in after))  # type: ignore[index]
           for k in ("cpu_pct", "gossip_Bps", "all_Bps")}
    print(f"largest view of any member with the clients connected: {result['largest_member_view']} peers")
    print("median member, without the clients (mean of before and gone) -> with them: cpu {0[0]:.2f} -> {0[1]:.2f} % "
          "of a core, gossip {1[0]:.0f} -> {1[1]:.0f} B/s, all streams {2[0]:.0f} -> {2[1]:.0f} B/s".format(
              med["cpu_pct"], med["gossip_Bps"], med["all_Bps"]))
    added = {k: 100 * (a / b - 1) if b else 0.0 for k, (b, a) in med.items()}
    print("added by the clients (median member): cpu {cpu_pct:+.1f} %, gossip bytes {gossip_Bps:+.1f} %, "
          "all stream bytes {all_Bps:+.1f} %".format(**added))
    result["median"], result["added_pct"] = med, added
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
