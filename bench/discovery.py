"""Discovery timings on one machine: DHT put/get/find across local py-libp2p nodes, QUIC listing fetch.

Starts ``--nodes`` DhtNodes on 127.0.0.1 (one bootstrap), then for ``--rounds`` rounds: a random
node publishes a fresh listing of its own mesh (``put``), another reads it (``get``, network
lookup), another lists every published mesh (``find``). Also times ``fetch_listing`` over QUIC
from a throwaway endpoint to a listing endpoint.

Then, through real nodes (``meshllm serve`` subprocesses, tiny model), for ``--node-rounds`` rounds:
``publish_visible`` is from running ``meshllm publish`` until a DHT client bootstrapped from
another node's DHT sees the listing; ``join_ready`` / ``join_member`` are from launching ``meshllm
join <mesh-id>`` (DHT only) until the node is ready / sees the publisher alive (includes process
start, about 1.5 s of imports). Prints medians and p90 and writes JSON.

Usage: ``python bench/discovery.py [--nodes 6] [--rounds 20] [--node-rounds 3] [--out bench/results/discovery.json]``
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

from nacl.signing import SigningKey

from meshllm.discovery.dht import DhtNode
from meshllm.discovery.listing import make_listing, new_open_invite
from meshllm.discovery.quic_listing import ListingServer, fetch_listing, listing_client
from meshllm.discovery.resolve import dht_lookup
from meshllm.mesh.admission import MeshKey

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from nodes import NodeProcess, meshllm, running_nodes, wait_until
from tinymodels import write_tiny_llama


def listing(key: MeshKey, name: str) -> bytes:
    now = time.time()
    invite = new_open_invite(key, ["127.0.0.1:9338"], now)
    return make_listing(key, name=name, open_invite=invite, bootstrap=["127.0.0.1:9338"], now=now)


async def timed(samples: list[float], coro: object) -> object:
    start = time.perf_counter()
    result = await coro  # type: ignore[misc]
    samples.append((time.perf_counter() - start) * 1000)
    return result


async def dht_rounds(count: int, rounds: int, rng: random.Random) -> dict[str, list[float]]:
    samples: dict[str, list[float]] = {"start": [], "put": [], "get": [], "find": []}
    nodes = [DhtNode() for _ in range(count)]
    await timed(samples["start"], nodes[0].start())
    for node in nodes[1:]:
        await timed(samples["start"], node.start(bootstrap=nodes[0].multiaddrs))
    keys = [MeshKey.generate() for _ in nodes]
    try:
        for round_ in range(rounds):
            writer, reader, finder = rng.sample(range(count), 3)
            await timed(samples["put"], nodes[writer].put_listing(listing(keys[writer], f"m{round_}")))
            got = await timed(samples["get"], nodes[reader].get_listing(keys[writer].mesh_id))
            assert got is not None and got.name == f"m{round_}", got
            found = await timed(samples["find"], nodes[finder].find_meshes())
            assert keys[writer].mesh_id in {item.mesh_id for item in found}  # type: ignore[union-attr]
    finally:
        await asyncio.gather(*(node.stop() for node in nodes))
    return samples


async def quic_fetch(rounds: int) -> list[float]:
    key, server, samples = MeshKey.generate(), ListingServer(), []
    server.publish(listing(key, "lan"), time.time())
    endpoint = await server.open_endpoint(SigningKey.generate(), "127.0.0.1", 0)
    try:
        for _ in range(rounds):
            async with listing_client("127.0.0.1") as client:
                await timed(samples, fetch_listing(client, endpoint.local_addr, 5.0, expected_mesh_id=key.mesh_id))
    finally:
        await endpoint.close()
    return samples


def node_rounds(rounds: int) -> dict[str, list[float]]:
    """Publish-to-visible and join-by-id through CLI nodes on 127.0.0.1 (a fresh pair of nodes per round)."""
    samples: dict[str, list[float]] = {"publish_visible": [], "join_ready": [], "join_member": []}
    for _ in range(rounds):
        node_round(samples)
    return samples


def node_round(samples: dict[str, list[float]]) -> None:
    """One round of :func:`node_rounds` with its own nodes and folder."""
    with tempfile.TemporaryDirectory() as tmp, running_nodes() as nodes:
        root = Path(tmp)
        model = write_tiny_llama(root / "tiny.gguf")
        owner = NodeProcess(root / "a", ["--model", str(model), "--dht-port", "0"], "a")
        nodes.append(owner)
        owner.wait_ready()
        peer = NodeProcess(root / "d", ["--client", "--dht-bootstrap", owner.dht_addr()], "d")
        nodes.append(peer)
        peer.wait_ready()
        bootstrap, mesh_id = peer.dht_addr(), owner.ready["mesh_id"]
        start = time.perf_counter()
        meshllm("publish", "--name", "bench", *owner.api_args).check_returncode()
        wait_until(lambda: bool(asyncio.run(dht_lookup([bootstrap], 5.0, mesh_id))), 30.0, interval=0.05)
        samples["publish_visible"].append((time.perf_counter() - start) * 1000)
        start = time.perf_counter()
        joiner = NodeProcess(root / "e", [mesh_id, "--client", "--dht-bootstrap", bootstrap], "e", command="join")
        nodes.append(joiner)
        joiner.wait_ready(60.0)
        samples["join_ready"].append((time.perf_counter() - start) * 1000)
        wait_until(lambda: any(p["node_id"] == owner.node_id and p["state"] == "alive"
                               for p in joiner.status()["peers"]), 30.0, interval=0.05)
        samples["join_member"].append((time.perf_counter() - start) * 1000)


def summary(values: list[float]) -> dict[str, float]:
    ordered = sorted(values)
    return {"n": len(ordered), "median_ms": statistics.median(ordered),
            "p90_ms": ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=6)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--node-rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path("bench/results/discovery.json"))
    args = parser.parse_args()
    samples = asyncio.run(dht_rounds(args.nodes, args.rounds, random.Random(1)))
    samples["quic_fetch"] = asyncio.run(quic_fetch(args.rounds))
    if args.node_rounds:
        samples.update(node_rounds(args.node_rounds))
    results = {name: summary(values) for name, values in samples.items()}
    print(f"{'operation':<16}{'n':>5}{'median ms':>12}{'p90 ms':>10}   ({args.nodes} DHT nodes on 127.0.0.1)")
    for name, row in results.items():
        print(f"{name:<16}{row['n']:>5}{row['median_ms']:>12.1f}{row['p90_ms']:>10.1f}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"nodes": args.nodes, "rounds": args.rounds, "results": results}, indent=2))


if __name__ == "__main__":
    main()
