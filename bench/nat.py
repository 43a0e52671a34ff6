"""NAT traversal benchmark: relayed vs punched connections between namespaces behind NATs.

Builds the lab of ``tests/netns/netns_lab.py`` (a relay on a public segment; hosts behind an
endpoint-independent and a symmetric NAT) and runs three agent processes per round, each in its
own namespace (``ip netns exec``) so no two endpoints share an interpreter: a relay, a target that
reserves a slot at it, and a dialer that measures

* time to a relayed connection (relayed dial, from a fresh endpoint already connected to the relay),
* RTT (median of 100-byte echo round trips) and throughput (8 MiB on one stream) over the relay,
* time from the first punch attempt to a direct (punched) connection, then RTT and throughput on it.

Pairs: ``eim`` (both behind MASQUERADE) and ``symmetric`` (target behind MASQUERADE --random-fully,
where the punch fails and traffic stays relayed). Needs root, ``ip`` and ``iptables``.

    sudo .venv/bin/python bench/nat.py --runs 3          # table on stdout, JSON in bench/results/nat.json
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import msgspec
from nacl.signing import SigningKey

sys.path[:0] = [str(Path(__file__).resolve().parents[1] / "tests"),
                str(Path(__file__).resolve().parents[1] / "tests" / "netns")]
from netns_lab import MESH_PORT, NatLab, missing_requirements  # noqa: E402

from meshllm.mesh.traversal import Traversal, parse_relay_entry, relay_entry  # noqa: E402
from meshllm.net import Endpoint, EndpointOptions, PeerConnection, Stream  # noqa: E402

BULK = 8 * 1024 * 1024
CHUNK = 64 * 1024
ROUND_TRIPS = 50


class Blob(msgspec.Struct):
    data: bytes


def admit_all(peer: str, proof: bytes, dialer: bool) -> None:
    """Benchmark agents admit each other without a mesh."""


async def make_endpoint(host: str, relay_mode: str) -> tuple[Endpoint, Traversal]:
    endpoint = await Endpoint.create(SigningKey.generate(), host, MESH_PORT, admit=admit_all,
                                     local_proof=lambda: b"", options=EndpointOptions())
    traversal = Traversal(endpoint, relay_mode, False, lambda *a, **k: None)  # type: ignore[arg-type]
    return endpoint, traversal


def say(**fields: Any) -> None:
    print(json.dumps(fields), flush=True)


# -- agents (each in its own namespace) ---------------------------------------------------------


async def agent_relay(host: str) -> None:
    endpoint, _ = await make_endpoint(host, "on")
    say(node_id=endpoint.node_id, addr=relay_entry(endpoint.node_id, endpoint.local_addr))
    await asyncio.Event().wait()


async def agent_target(host: str, relay: str) -> None:
    endpoint, traversal = await make_endpoint(host, "off")

    async def echo(stream: Stream, _peer: PeerConnection) -> None:
        while (blob := await stream.recv(Blob, timeout=60)) is not None:
            await stream.send(blob)

    async def sink(stream: Stream, _peer: PeerConnection) -> None:
        total = 0
        while (blob := await stream.recv(Blob, timeout=60)) is not None:
            total += len(blob.data)
        await stream.send(total)

    endpoint.on_stream("echo", echo)
    endpoint.on_stream("sink", sink)
    relay_id, relay_addr = parse_relay_entry(relay)
    assert await traversal.reserve(relay_id, relay_addr), "reservation refused"
    say(node_id=endpoint.node_id)
    await asyncio.Event().wait()


async def measure(conn: PeerConnection) -> dict[str, float]:
    stream = await conn.open_stream("echo")
    samples = []
    for _ in range(ROUND_TRIPS):
        start = time.perf_counter()
        await stream.send(Blob(b"x" * 100))
        await stream.recv(Blob, timeout=10)
        samples.append((time.perf_counter() - start) * 1000)
    stream.close()
    bulk = await conn.open_stream("sink")
    start = time.perf_counter()
    for _ in range(BULK // CHUNK):
        await bulk.send(Blob(b"y" * CHUNK), timeout=60)
    bulk.close()
    assert await bulk.recv(int, timeout=60) == BULK
    return {"rtt_ms": statistics.median(samples), "mb_s": BULK / (time.perf_counter() - start) / 1e6}


async def agent_dialer(host: str, relay: str, target: str) -> None:
    endpoint, traversal = await make_endpoint(host, "off")
    relay_id, relay_addr = parse_relay_entry(relay)
    await endpoint.connect(relay_addr, expected_node_id=relay_id, timeout=5)
    start = time.perf_counter()
    conn = await traversal.dial_via(relay_id, relay_addr, target, timeout=5)
    result: dict[str, Any] = {"relayed_ms": (time.perf_counter() - start) * 1000}
    result["relayed"] = await measure(conn)
    start = time.perf_counter()
    while time.perf_counter() - start < 8.0:
        traversal.tick(time.time(), [])
        if endpoint.peers[target].path == "punched":
            result["punch_ms"] = (time.perf_counter() - start) * 1000
            result["punched"] = await measure(endpoint.peers[target])
            break
        await asyncio.sleep(0.01)
    say(**result)
    await traversal.close()
    await endpoint.close()


# -- the coordinator ----------------------------------------------------------------------------


class Agent:
    def __init__(self, ns: str, *args: str) -> None:
        cmd = ["ip", "netns", "exec", ns, sys.executable, __file__, "--agent", *args]
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=env)

    def line(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        text = self.proc.stdout.readline()
        if not text:
            raise RuntimeError(f"agent {self.proc.args} exited ({self.proc.wait()})")
        return json.loads(text)  # type: ignore[no-any-return]

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait()


def one_round(lab: NatLab, target_site: str) -> dict[str, Any]:
    agents: list[Agent] = []
    try:
        relay = Agent(lab.sites["relay"].ns, "relay", lab.sites["relay"].ip)
        agents.append(relay)
        relay_addr = relay.line()["addr"]
        target = Agent(lab.sites[target_site].ns, "target", lab.sites[target_site].ip, relay_addr)
        agents.append(target)
        target_id = target.line()["node_id"]
        dialer = Agent(lab.sites["a"].ns, "dialer", lab.sites["a"].ip, relay_addr, target_id)
        agents.append(dialer)
        return dialer.line()
    finally:
        for agent in agents:
            agent.stop()


def median(rounds: list[dict[str, Any]], *keys: str) -> float | None:
    values = []
    for r in rounds:
        value: Any = r
        for key in keys:
            value = value.get(key) if isinstance(value, dict) else None
        if value is not None:
            values.append(float(value))
    return round(statistics.median(values), 2) if values else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "nat.json")
    parser.add_argument("--agent", nargs="+", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.agent:
        role, *params = args.agent
        agent = {"relay": agent_relay, "target": agent_target, "dialer": agent_dialer}[role]
        asyncio.run(agent(*params))  # type: ignore[operator]
        return
    if (reason := missing_requirements()) is not None:
        sys.exit(f"bench/nat.py: {reason}")
    lab = NatLab(f"mb{os.getpid() % 100000}").build({"a": "eim", "b": "eim", "s": "symmetric"})
    results: dict[str, Any] = {}
    try:
        for pair, site in (("eim", "b"), ("symmetric", "s")):
            rounds = [one_round(lab, site) for _ in range(args.runs)]
            results[pair] = {
                "runs": rounds,
                "punched": sum("punched" in r for r in rounds),
                "median": {
                    "relayed_connect_ms": median(rounds, "relayed_ms"),
                    "relayed_rtt_ms": median(rounds, "relayed", "rtt_ms"),
                    "relayed_mb_s": median(rounds, "relayed", "mb_s"),
                    "punch_ms": median(rounds, "punch_ms"),
                    "punched_rtt_ms": median(rounds, "punched", "rtt_ms"),
                    "punched_mb_s": median(rounds, "punched", "mb_s"),
                },
            }
    finally:
        lab.destroy()
    header = ("pair", "punched", "relayed connect ms", "relayed RTT ms", "relayed MB/s", "punch ms",
              "punched RTT ms", "punched MB/s")
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for pair, data in results.items():
        m = data["median"]
        cells = [pair, f"{data['punched']}/{args.runs}", m["relayed_connect_ms"], m["relayed_rtt_ms"],
                 m["relayed_mb_s"], m["punch_ms"], m["punched_rtt_ms"], m["punched_mb_s"]]
        print("| " + " | ".join("-" if c is None else str(c) for c in cells) + " |")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"date": datetime.date.today().isoformat(), "runs": args.runs,
                                    "bulk_bytes": BULK, "results": results}, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
