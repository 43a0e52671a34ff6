"""The DHT: four local py-libp2p nodes on 127.0.0.1 store, find and expire signed listings."""

from __future__ import annotations

import asyncio
import time

import pytest

from meshllm.discovery.dht import DhtError, DhtNode, check_listing_record, listing_key, pick_newest
from meshllm.discovery.listing import make_listing, new_open_invite
from meshllm.errors import BadSignature, Expired, VerificationError
from meshllm.identity.signing import Signed, decode_signed, encode_signed
from meshllm.mesh.admission import MeshKey

pytestmark = pytest.mark.discovery
TTL_S = 3.0


def signed_listing(key: MeshKey, now: float, ttl_s: float = TTL_S, name: str = "lab") -> bytes:
    invite = new_open_invite(key, ["127.0.0.1:9338"], now)
    return make_listing(key, name=name, open_invite=invite, bootstrap=["127.0.0.1:9338"], now=now, ttl_s=ttl_s)


def tamper(raw: bytes) -> bytes:
    signed = decode_signed(raw)
    body = bytearray(signed.body)
    body[body.index(b"lab")] ^= 1
    return encode_signed(Signed(signed.domain, signed.signer, bytes(body), signed.sig))


def test_record_checks_are_pure() -> None:
    key, now = MeshKey.generate(), 1_700_000_000.0
    old, new = signed_listing(key, now), signed_listing(key, now + 1)
    assert check_listing_record(listing_key(key.mesh_id), old, now + 1).mesh_id == key.mesh_id
    with pytest.raises(VerificationError):
        check_listing_record(listing_key(MeshKey.generate().mesh_id), old, now)
    with pytest.raises(BadSignature):
        check_listing_record(listing_key(key.mesh_id), tamper(old), now)
    with pytest.raises(Expired):
        check_listing_record(listing_key(key.mesh_id), old, now + TTL_S)
    assert pick_newest([old, new, tamper(new)], now + 1) == 1


async def _network(count: int) -> list[DhtNode]:
    """``count`` nodes bootstrapped from the first; the last one is a client (asks, never stores)."""
    nodes = [DhtNode(server=i < count - 1) for i in range(count)]
    await nodes[0].start()
    await asyncio.gather(*(node.start(bootstrap=nodes[0].multiaddrs) for node in nodes[1:]))
    return nodes


def test_put_get_find_and_expiry() -> None:
    pytest.importorskip("libp2p")

    async def main() -> dict[str, float]:
        nodes = await _network(4)
        key, other = MeshKey.generate(), MeshKey.generate()
        times: dict[str, float] = {}
        try:
            raw = signed_listing(key, time.time())
            start = time.perf_counter()
            await nodes[1].put_listing(raw, timeout=5)
            times["put"] = time.perf_counter() - start
            start = time.perf_counter()
            got = await nodes[3].get_listing(key.mesh_id, timeout=5)
            times["get"] = time.perf_counter() - start
            assert got is not None and got.name == "lab"
            start = time.perf_counter()
            found = await nodes[2].find_meshes(timeout=5)
            times["find"] = time.perf_counter() - start
            assert [item.mesh_id for item in found] == [key.mesh_id]
            assert await nodes[0].get_listing(other.mesh_id, timeout=5) is None

            # A newer listing replaces the older one for readers that already cached the old one.
            await nodes[1].put_listing(signed_listing(key, time.time(), name="lab2"), timeout=5)
            got = await nodes[3].get_listing(key.mesh_id, timeout=5)
            assert got is not None and got.name == "lab2"

            # Refused locally before anything is sent ...
            with pytest.raises(BadSignature):
                await nodes[1].put_listing(tamper(raw))
            # ... and by the validator of a DHT peer that is sent a tampered or expired listing anyway.
            forged_key = MeshKey.generate()
            expired = signed_listing(forged_key, time.time() - 10, ttl_s=5)
            for bad in (tamper(signed_listing(forged_key, time.time())), expired):
                with pytest.raises(DhtError):
                    await nodes[1]._call(nodes[1]._put, listing_key(forged_key.mesh_id), bad, timeout=5)
                target = nodes[2]
                await nodes[1]._call(_store_at, nodes[1], target, forged_key.mesh_id, bad, timeout=5)
                assert await target._call(_holds, target, forged_key.mesh_id, timeout=5) is False
            assert await nodes[0].get_listing(forged_key.mesh_id, timeout=5) is None

            # Unpublished: the node stops republishing; the listing drops out within its TTL.
            await asyncio.sleep(max(0.0, got.expires - time.time()) + 0.2)
            assert await nodes[2].find_meshes(timeout=5) == []
            assert await nodes[3].get_listing(key.mesh_id, timeout=5) is None
        finally:
            await asyncio.gather(*(node.stop() for node in nodes))
        return times

    times = asyncio.run(asyncio.wait_for(main(), 40))
    print("DHT times (s):", {k: round(v, 4) for k, v in times.items()})


async def _store_at(sender: DhtNode, target: DhtNode, mesh_id: str, value: bytes) -> None:
    """Send PUT_VALUE straight to ``target``, skipping the sender's own validation (as a hostile node would)."""
    await sender._dht.value_store._store_at_peer(target._host.get_id(), listing_key(mesh_id).encode(), value)


async def _holds(node: DhtNode, mesh_id: str) -> bool:
    """Whether ``node`` stored a record for ``mesh_id`` (run in its own trio thread)."""
    return node._dht.value_store.get(listing_key(mesh_id).encode()) is not None


def test_unreachable_bootstrap_is_a_typed_error() -> None:
    pytest.importorskip("libp2p")

    async def main() -> None:
        node = DhtNode()
        nobody = "/ip4/127.0.0.1/tcp/9/p2p/12D3KooWDnjgnX2xZmhf3LfCyc7MXG9UGqJQ1hXoivzMuSTaUhVB"
        with pytest.raises(DhtError, match="bootstrap"):
            await node.start(bootstrap=[nobody], timeout=5)
        with pytest.raises(DhtError, match="not running"):
            await node.get_listing("mesh-x")

    asyncio.run(main())
