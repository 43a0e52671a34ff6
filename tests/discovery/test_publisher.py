"""The node-side publisher and the reader-side resolver, below the CLI.

Publisher: republishes on its own every half TTL, keeps one open invite across republishes, and
withdraws its listing on stop. Resolver: listings with a bad signature, an expired one, or one
whose mesh id is not its signing key's are ignored and logged, whether fetched over QUIC (the
mDNS path) or from a DHT provider.
"""

from __future__ import annotations

import asyncio
import logging
import time

import msgspec
import pytest
from nacl.signing import SigningKey
from net.net_helpers import until
from test_dht import signed_listing, tamper

from meshllm.discovery.dht import DhtNode
from meshllm.discovery.listing import LISTING_DOMAIN, Capacity, MeshListing, verify_listing
from meshllm.discovery.mdns import Candidate
from meshllm.discovery.publisher import ListingFacts, Publisher, facts_from_records, lan_scope
from meshllm.discovery.quic_listing import ListingServer, fetch_listing, listing_client
from meshllm.discovery.resolve import NothingFound, fetch_candidates, find_listing, merge
from meshllm.identity.ids import node_id
from meshllm.identity.signing import encode_signed, sign
from meshllm.mesh.admission import MeshKey
from meshllm.mesh.records import Addresses, DemandEntry, Load, Models, PeerRecord, ServedModel
from meshllm.mesh.records import Capacity as NodeCapacity

NOW = 1_800_000_000.0


def record(name: str, addr: str, models: list[str], ram: int, vram: int = 0, tok_s: float = 0.0,
           demand: tuple[DemandEntry, ...] = ()) -> PeerRecord:
    return PeerRecord(node_id=name, mesh_id="m", seq=1, membership_proof=b"", name=name,
                      addresses=Addresses(listen=[addr]), capacity=NodeCapacity(ram_bytes=ram, vram_bytes=vram),
                      models=Models(served=[ServedModel(name=m, context=512) for m in models]), load=Load(tok_s=tok_s),
                      demand=list(demand))


def test_facts_and_lan_scope() -> None:
    asked = (DemandEntry("x", 5, 0, NOW - 1), DemandEntry("z", 2, 2, NOW - 2), DemandEntry("old", 9, 9, NOW - 3600))
    facts = facts_from_records(record("a", "10.0.0.1:1", ["x"], 4, tok_s=2.5),
                               [record("b", "10.0.0.2:1", ["x", "y"], 6, vram=8, tok_s=1.0, demand=asked)], NOW)
    assert facts.bootstrap == ["10.0.0.1:1", "10.0.0.2:1"] and facts.models_served == ["x", "y"]
    assert facts.models_wanted == ["z"]  # x is served and keeps up; the old demand has expired
    assert facts.node_count == 2 and facts.capacity == Capacity(ram_bytes=10, vram_bytes=8, gpu_nodes=1,
                                                                tokens_per_s=3.5)
    assert lan_scope("127.0.0.1") is None and lan_scope("0.0.0.0") == [] and lan_scope("10.1.2.3") == ["10.1.2.3"]


def test_publisher_republishes_reuses_its_invite_and_withdraws() -> None:
    async def main() -> None:
        key, node_key = MeshKey.generate(), SigningKey.generate()
        facts = ListingFacts(bootstrap=["127.0.0.1:9338"], models_served=["tiny"], node_count=1, capacity=Capacity())
        publisher = Publisher(key, node_key, node_id(bytes(node_key.verify_key)), lambda: facts, quic_port=9338,
                              dht=None, lan=None, listing_host="127.0.0.1", ttl_s=2.0)
        first = await publisher.start("demo")
        assert first.expires - first.issued == 2.0 and publisher.interval_s == 1.0
        port = publisher._endpoint.local_addr[1]  # type: ignore[union-attr]
        async with listing_client("127.0.0.1") as client:
            got = await fetch_listing(client, ("127.0.0.1", port), 5.0, expected_mesh_id=key.mesh_id)
            assert got == first and got.models_served == ["tiny"]
            await until(lambda: publisher.listing is not None and publisher.listing.issued > first.issued,
                        3.0)  # one republish by the loop (every interval_s = 1 s)
            assert publisher.listing.open_invite == first.open_invite
            renamed = await publisher.rename("demo2")
            assert renamed.name == "demo2" and renamed.open_invite == first.open_invite
            await publisher.stop()
            assert key.mesh_id not in publisher.server.listings
            with pytest.raises(Exception):  # noqa: B017 - the endpoint is gone: a transport error of some kind
                await fetch_listing(client, ("127.0.0.1", port), 1.0, expected_mesh_id=key.mesh_id)

    asyncio.run(asyncio.wait_for(main(), 30))


def bad_listings(now: float) -> dict[str, tuple[MeshKey, bytes]]:
    """Three refusable listings, each under the mesh id it claims."""
    forged, stale, victim, impostor = (MeshKey.generate() for _ in range(4))
    good = verify_listing(signed_listing(victim, now), now)
    wrong_key = encode_signed(sign(impostor.signing_key, LISTING_DOMAIN, msgspec.structs.replace(good, name="evil")))
    return {
        "BadSignature": (forged, tamper(signed_listing(forged, now))),
        "Expired": (stale, signed_listing(stale, now - 100, ttl_s=10)),
        "WrongMesh": (victim, wrong_key),
    }


def test_bad_listings_over_quic_are_ignored_and_logged(caplog: pytest.LogCaptureFixture) -> None:
    async def main() -> list[MeshListing]:
        now, node_key, server = time.time(), SigningKey.generate(), ListingServer()
        bad = bad_listings(now)
        good_key = MeshKey.generate()
        server.publish(signed_listing(good_key, now), now)
        for key, raw in bad.values():
            server.listings[key.mesh_id] = raw
        endpoint = await server.open_endpoint(node_key, "127.0.0.1", 0)
        me, port = node_id(bytes(node_key.verify_key)), endpoint.local_addr[1]
        try:
            candidates = [Candidate("127.0.0.1", port, key.mesh_id, "x", me, 9338)
                          for key in [good_key, *(k for k, _ in bad.values())]]
            return await fetch_candidates(candidates, interfaces=["127.0.0.1"])
        finally:
            await endpoint.close()

    with caplog.at_level(logging.INFO, logger="meshllm.discovery"):
        found = asyncio.run(asyncio.wait_for(main(), 30))
    assert [item.name for item in found] == ["lab"]
    refused = {r.getMessage().rsplit("(", 1)[-1].rstrip(")"): r.levelno for r in caplog.records
               if "ignoring a mesh listing" in r.getMessage()}
    assert refused == {"BadSignature": logging.WARNING, "Expired": logging.INFO, "WrongMesh": logging.WARNING}


def test_bad_listings_from_a_dht_provider_are_ignored_and_logged(caplog: pytest.LogCaptureFixture) -> None:
    pytest.importorskip("libp2p")

    async def main() -> list[MeshListing]:
        now = time.time()
        provider, reader = DhtNode(), DhtNode(server=False)
        await provider.start()
        await reader.start(bootstrap=provider.multiaddrs)
        try:
            good = MeshKey.generate()
            await provider.put_listing(signed_listing(good, now))
            for key, raw in bad_listings(now).values():
                provider._published[key.mesh_id] = raw  # a hostile provider serves them anyway
            return await reader.find_meshes(timeout=5)
        finally:
            await asyncio.gather(reader.stop(), provider.stop())

    with caplog.at_level(logging.INFO, logger="meshllm.discovery"):
        found = asyncio.run(asyncio.wait_for(main(), 30))
    assert [item.name for item in found] == ["lab"]
    kinds = {r.getMessage().rsplit("(", 1)[-1].rstrip(")") for r in caplog.records
             if "ignoring a mesh listing from the DHT" in r.getMessage()}
    assert kinds == {"BadSignature", "Expired", "WrongMesh"}


def test_merge_keeps_the_newest_and_tags_sources() -> None:
    key, now = MeshKey.generate(), time.time()
    old, new = (verify_listing(signed_listing(key, t, ttl_s=60), now) for t in (now - 5, now))
    (found,) = merge([old], [new])
    assert found.listing == new and found.via == "lan+dht"


def test_find_listing_with_nowhere_to_look_says_so() -> None:
    with pytest.raises(NothingFound, match="no LAN to browse and no DHT bootstrap"):
        asyncio.run(find_listing(MeshKey.generate().mesh_id, interfaces=None, bootstrap=[], timeout=2))
