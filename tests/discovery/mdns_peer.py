"""One side of the mDNS test, run inside a network namespace (``ip netns exec NS python mdns_peer.py``).

``advertise IP``: publish a fresh mesh's listing on a listing endpoint and advertise it over mDNS;
prints ``{"mesh_id", "node_id"}`` and runs until stdin closes.
``browse IP MESH_ID SECONDS``: browse until that mesh shows up, fetch and verify its listing over
QUIC; prints what was found as JSON (exit 1 if nothing within SECONDS).
"""

from __future__ import annotations

import asyncio
import json
import sys
import time

from nacl.signing import SigningKey

from meshllm.discovery.listing import make_listing, new_open_invite
from meshllm.discovery.mdns import MdnsAdvertiser, browse
from meshllm.discovery.quic_listing import ListingServer, fetch_listing, listing_client
from meshllm.identity.ids import node_id
from meshllm.mesh.admission import MeshKey


async def advertise(ip: str) -> None:
    key, node_key, now = MeshKey.generate(), SigningKey.generate(), time.time()
    bootstrap = [f"{ip}:9338"]
    server = ListingServer()
    server.publish(make_listing(key, name="lan-mesh", open_invite=new_open_invite(key, bootstrap, now),
                                bootstrap=bootstrap, now=now, ttl_s=600), now)
    endpoint = await server.open_endpoint(node_key, ip, 0)
    me = node_id(bytes(node_key.verify_key))
    advertiser = MdnsAdvertiser(mesh_id=key.mesh_id, name="lan-mesh", node_id=me,
                                listing_port=endpoint.local_addr[1], quic_port=9338, addresses=[ip], interfaces=[ip])
    await advertiser.start()
    print(json.dumps({"mesh_id": key.mesh_id, "node_id": me}), flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
    await advertiser.stop()
    await endpoint.close()


async def find(ip: str, mesh_id: str, seconds: float) -> int:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        for cand in await browse(1.5, interfaces=[ip]):
            if cand.mesh_id != mesh_id:
                continue
            start = time.perf_counter()
            async with listing_client(ip) as endpoint:
                listing = await fetch_listing(endpoint, (cand.addr, cand.port), 5.0, expected_mesh_id=mesh_id,
                                              expected_node_id=cand.node_id)
            print(json.dumps({"mesh_id": listing.mesh_id, "name": listing.name, "addr": cand.addr,
                              "node_id": cand.node_id, "quic_port": cand.quic_port,
                              "fetch_s": time.perf_counter() - start}), flush=True)
            return 0
    return 1


if __name__ == "__main__":
    if sys.argv[1] == "advertise":
        asyncio.run(advertise(sys.argv[2]))
    else:
        sys.exit(asyncio.run(find(sys.argv[2], sys.argv[3], float(sys.argv[4]))))
