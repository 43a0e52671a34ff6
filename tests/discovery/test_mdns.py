"""mDNS on a LAN of two network namespaces, plus the QUIC listing fetch on 127.0.0.1.

The namespace test builds its own LAN: namespaces A and B joined by a bridge that lives in a third
namespace, so no multicast ever reaches the host's interfaces.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from lan import two_host_lan
from nacl.signing import SigningKey

from meshllm.discovery.listing import make_listing, new_open_invite
from meshllm.discovery.mdns import parse_txt, txt_record
from meshllm.discovery.quic_listing import ListingServer, NoListing, fetch_listing, listing_client
from meshllm.errors import DecodeError, Expired, WrongMesh
from meshllm.identity.ids import node_id
from meshllm.mesh.admission import MeshKey
from meshllm.net.errors import PeerMismatch

PEER = Path(__file__).with_name("mdns_peer.py")


def test_txt_round_trip_and_malformed() -> None:
    key, node = MeshKey.generate(), node_id(bytes(SigningKey.generate().verify_key))
    txt = {k.encode(): v.encode() for k, v in txt_record(key.mesh_id, "lab", node, 9338).items()}
    assert parse_txt(txt) == (key.mesh_id, "lab", node, 9338)
    for broken in ({**txt, b"mesh": b"mesh-nope"}, {**txt, b"quic": b"99999"}, {**txt, b"node": b"x"},
                   {**txt, b"v": b"2"}, {b"mesh": b"\xff"}):
        with pytest.raises(DecodeError):
            parse_txt(broken)


def test_fetch_listing_over_quic_without_membership() -> None:
    async def main() -> None:
        key, other, node_key, now = MeshKey.generate(), MeshKey.generate(), SigningKey.generate(), time.time()
        server = ListingServer()
        invite = new_open_invite(key, ["127.0.0.1:9338"], now)
        server.publish(make_listing(key, name="lab", open_invite=invite, bootstrap=["127.0.0.1:9338"], now=now), now)
        endpoint = await server.open_endpoint(node_key, "127.0.0.1", 0)
        me = node_id(bytes(node_key.verify_key))
        try:
            async with listing_client("127.0.0.1") as client:
                addr = endpoint.local_addr
                got = await fetch_listing(client, addr, 5.0, expected_mesh_id=key.mesh_id, expected_node_id=me)
                assert got.name == "lab"
                with pytest.raises(NoListing):
                    await fetch_listing(client, addr, 5.0, expected_mesh_id=other.mesh_id)
                with pytest.raises(Expired):
                    await fetch_listing(client, addr, 5.0, expected_mesh_id=key.mesh_id, clock=lambda: now + 1e4)
                with pytest.raises(PeerMismatch):
                    await fetch_listing(client, addr, 5.0, expected_mesh_id=key.mesh_id,
                                        expected_node_id=node_id(bytes(SigningKey.generate().verify_key)))
            # A node that serves another mesh's listing under the advertised id is caught too.
            server.listings[other.mesh_id] = server.listings[key.mesh_id]
            async with listing_client("127.0.0.1") as client:
                with pytest.raises(WrongMesh):
                    await fetch_listing(client, endpoint.local_addr, 5.0, expected_mesh_id=other.mesh_id)
        finally:
            await endpoint.close()

    asyncio.run(asyncio.wait_for(main(), 30))


@pytest.fixture
def lan() -> Iterator[tuple[str, str, str, str]]:
    """Namespaces A (10.231.0.1) and B (10.231.0.2) on a bridge inside a hub namespace."""
    with two_host_lan(f"mdt{os.getpid() % 100000}", "10.231.0") as hosts:
        yield hosts


@pytest.mark.netns
@pytest.mark.discovery
def test_mdns_between_namespaces(lan: tuple[str, str, str, str]) -> None:
    ns_a, ip_a, ns_b, ip_b = lan
    advertiser = subprocess.Popen(["ip", "netns", "exec", ns_a, sys.executable, str(PEER), "advertise", ip_a],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert advertiser.stdout is not None
        line = advertiser.stdout.readline()
        assert line, f"advertiser failed: {advertiser.stderr.read() if advertiser.stderr else ''}"
        published = json.loads(line)
        found = subprocess.run(["ip", "netns", "exec", ns_b, sys.executable, str(PEER), "browse", ip_b,
                                published["mesh_id"], "15"], capture_output=True, text=True, timeout=40)
        assert found.returncode == 0, found.stderr
        got = json.loads(found.stdout)
        assert got["mesh_id"] == published["mesh_id"] and got["node_id"] == published["node_id"]
        assert got["name"] == "lan-mesh" and got["addr"] == ip_a and got["quic_port"] == 9338
    finally:
        if advertiser.stdin is not None:
            advertiser.stdin.close()
        try:
            advertiser.wait(timeout=10)
        except subprocess.TimeoutExpired:
            advertiser.kill()
