"""Node side of publishing: keep a signed listing of our mesh fresh in the DHT, on mDNS and over QUIC.

Listings are short-lived on purpose (see :mod:`.listing`), so publishing is a loop: every half TTL
(60 s for the default 120 s) the owner re-signs a listing from what gossip says now (members,
models, capacity) and pushes it to the listing endpoint, the DHT and the mDNS advertisement.
Unpublishing just stops the loop and withdraws what is withdrawable at once (the listing endpoint,
the DHT provider protocol, mDNS goodbye packets); copies stored in the DHT die at their expiry.

The open invite inside the listing is made once and reused across republishes (a joiner who read
an older listing still holds a valid invite); it is renewed only when half its life is gone.

:class:`NodeDiscovery` is what the node owns: the optional DHT node (server mode) and at most one
:class:`Publisher`, behind the calls the HTTP routes make (:mod:`.routes`).
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from nacl.signing import SigningKey

from meshllm.discovery.dht import DhtNode
from meshllm.discovery.listing import (
    LISTING_TTL_S,
    OPEN_INVITE_TTL_S,
    Capacity,
    MeshListing,
    make_listing,
    new_open_invite,
)
from meshllm.discovery.mdns import MdnsAdvertiser
from meshllm.discovery.quic_listing import ListingServer
from meshllm.errors import ConfigError, MeshllmError
from meshllm.mesh.admission import MeshKey, inspect_token
from meshllm.mesh.demand import record_demand, wanted_models
from meshllm.mesh.records import PeerRecord
from meshllm.net.endpoint import Endpoint
from meshllm.net.interfaces import lan_addresses

log = logging.getLogger(__name__)

MAX_BOOTSTRAP = 8
"""Member addresses put in a listing: enough to survive a few dead members, small enough to stay terse."""

OnEvent = Callable[..., None]


@dataclass(frozen=True)
class ListingFacts:
    """What a listing says about the mesh beyond its name: read from gossip at each republish."""

    bootstrap: list[str]
    models_served: list[str]
    node_count: int
    capacity: Capacity
    models_wanted: list[str] = field(default_factory=list)


def facts_from_records(own: PeerRecord, members: list[PeerRecord], now: float) -> ListingFacts:
    """Summarise our record and the live members' records (ours first in the bootstrap list).

    ``models_wanted``: models the mesh's clients asked for in the last minute that nobody serves or
    that were refused everywhere for lack of capacity (``mesh/demand.py``).
    """
    records = [own, *members]
    served = sorted({m.name for r in records for m in r.models.served})
    wanted = wanted_models(record_demand(records, now), served, now=now)
    addrs: list[str] = []
    for record in records:
        for addr in record.addresses.listen:
            if addr not in addrs:
                addrs.append(addr)
    capacity = Capacity(
        ram_bytes=sum(r.capacity.ram_bytes for r in records),
        vram_bytes=sum(r.capacity.vram_bytes for r in records),
        gpu_nodes=sum(1 for r in records if r.capacity.vram_bytes > 0),
        tokens_per_s=round(sum(r.load.tok_s for r in records), 1),
    )
    return ListingFacts(bootstrap=addrs[:MAX_BOOTSTRAP], models_served=served[:64], models_wanted=wanted[:64],
                        node_count=len(records), capacity=capacity)


def lan_scope(host: str) -> list[str] | None:
    """mDNS interfaces for a node whose mesh endpoint binds ``host``.

    ``None``: no mDNS at all, because the endpoint is on loopback and nobody on a LAN could dial it
    (this also keeps tests on 127.0.0.1 from multicasting on the host's network). ``[]``: every
    interface (a wildcard bind). ``[host]``: that interface only.
    """
    if host in ("0.0.0.0", "::", ""):
        return []
    try:
        if ipaddress.ip_address(host).is_loopback:
            return None
    except ValueError:
        return []
    return [host]


class Publisher:
    """Publishes one mesh until :meth:`stop`: listing endpoint, DHT (optional) and mDNS (optional)."""

    def __init__(self, mesh_key: MeshKey, node_key: SigningKey, node_id: str, facts: Callable[[], ListingFacts], *,
                 quic_port: int, dht: DhtNode | None, lan: list[str] | None, listing_host: str,
                 ttl_s: float = LISTING_TTL_S, clock: Callable[[], float] = time.time) -> None:
        self.mesh_key, self.node_key, self.node_id = mesh_key, node_key, node_id
        self.facts, self.quic_port = facts, quic_port
        self.dht, self.lan, self.listing_host = dht, lan, listing_host
        self.ttl_s, self.clock = ttl_s, clock
        self.name = ""
        self.listing: MeshListing | None = None
        """The listing pushed last."""
        self.server = ListingServer()
        self._invite: str | None = None
        self._endpoint: Endpoint | None = None
        self._advertiser: MdnsAdvertiser | None = None
        self._task: asyncio.Task[None] | None = None

    @property
    def advertising(self) -> bool:
        """Whether the mesh is advertised over mDNS right now."""
        return self._advertiser is not None

    @property
    def interval_s(self) -> float:
        """Republish every half TTL: one lost republish never hides the mesh."""
        return self.ttl_s / 2

    async def start(self, name: str) -> MeshListing:
        """Open the listing endpoint, push the first listing, advertise on the LAN, start republishing."""
        self.name = name
        self._endpoint = await self.server.open_endpoint(self.node_key, self.listing_host, 0)
        listing = await self.republish()
        if self.lan is not None:
            await self._advertise()
        self._task = asyncio.create_task(self._loop(), name="publish-listing")
        return listing

    async def rename(self, name: str) -> MeshListing:
        """Publish under a new name at once (the mDNS TXT record carries the name, so re-advertise)."""
        self.name = name
        listing = await self.republish()
        if self._advertiser is not None and self._advertiser.name != name:
            await self._advertiser.stop()
            await self._advertise()
        return listing

    async def republish(self) -> MeshListing:
        """Sign a fresh listing and push it everywhere; a DHT failure is logged, not raised (LAN still works)."""
        now = self.clock()
        facts = self.facts()
        raw = make_listing(
            self.mesh_key, name=self.name, open_invite=self._open_invite(facts.bootstrap, now),
            bootstrap=facts.bootstrap, now=now, models_served=facts.models_served,
            models_wanted=facts.models_wanted, node_count=facts.node_count, capacity=facts.capacity,
            ttl_s=self.ttl_s,
        )
        self.listing = self.server.publish(raw, now)
        if self.dht is not None:
            try:
                await self.dht.put_listing(raw, timeout=min(10.0, self.interval_s))
            except MeshllmError as exc:
                log.warning("could not store the listing of %s in the DHT: %s", self.mesh_key.mesh_id, exc)
        return self.listing

    async def stop(self) -> None:
        """Stop republishing and withdraw everything that can be withdrawn now."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.wait([self._task])  # (not ``await``: that would swallow our own cancellation)
            self._task = None
        self.server.unpublish(self.mesh_key.mesh_id)
        if self.dht is not None:
            self.dht.unpublish(self.mesh_key.mesh_id)
        if self._advertiser is not None:
            await self._advertiser.stop()
            self._advertiser = None
        if self._endpoint is not None:
            await self._endpoint.close()
            self._endpoint = None

    def _open_invite(self, bootstrap: list[str], now: float) -> str:
        """The open invite, reused until half its life is gone (older listings' invites stay valid)."""
        if self._invite is None or inspect_token(self._invite).expires - now < OPEN_INVITE_TTL_S / 2:
            self._invite = new_open_invite(self.mesh_key, bootstrap, now)
        return self._invite

    async def _advertise(self) -> None:
        assert self._endpoint is not None
        scope = self.lan or []
        self._advertiser = MdnsAdvertiser(
            mesh_id=self.mesh_key.mesh_id, name=self.name, node_id=self.node_id,
            listing_port=self._endpoint.local_addr[1], quic_port=self.quic_port,
            addresses=scope or None, interfaces=scope or None,
        )
        try:
            await self._advertiser.start()
        except OSError as exc:  # no multicast-capable interface: the DHT may still carry the listing
            log.warning("mDNS advertising failed: %s", exc)
            self._advertiser = None

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                await self.republish()
            except MeshllmError as exc:
                log.warning("republishing %s failed: %s", self.mesh_key.mesh_id, exc)



class NotMeshOwner(ConfigError):
    """Only the node holding the mesh key can sign listings (and the open invite inside them)."""

    hint = "run `meshllm publish --api URL` against the node that created the mesh"


class NodeDiscovery:
    """A node's discovery side: its DHT node (while it takes part in the DHT) and its publication.

    The DHT node runs in server mode (it stores records for others) from start when the node has
    DHT bootstrap peers or a fixed DHT port, else from the first publish; it is never stopped by
    unpublishing, since other nodes may use it as their bootstrap peer.
    """

    def __init__(self, *, node_key: SigningKey, node_id: str, node_name: str, mesh_key: MeshKey | None,
                 facts: Callable[[], ListingFacts], quic_port: int, host: str, dht_bootstrap: list[str],
                 dht_port: int | None, listing_ttl_s: float, on_event: OnEvent) -> None:
        self.node_key, self.node_id, self.node_name, self.mesh_key = node_key, node_id, node_name, mesh_key
        self.facts, self.quic_port, self.host = facts, quic_port, host
        self.dht_bootstrap, self.dht_port, self.listing_ttl_s = list(dht_bootstrap), dht_port, listing_ttl_s
        self.on_event = on_event
        self.dht: DhtNode | None = None
        self.dht_error = ""
        self.publisher: Publisher | None = None
        self._lock = asyncio.Lock()

    async def start(self) -> None:
        """Join the DHT now if asked to (bootstrap peers or a fixed port); a failure is reported, not fatal."""
        if self.dht_bootstrap or self.dht_port is not None:
            await self._ensure_dht()

    async def stop(self) -> None:
        async with self._lock:
            if self.publisher is not None:
                await self.publisher.stop()
                self.publisher = None
            if self.dht is not None:
                await self.dht.stop()
                self.dht = None

    async def publish(self, name: str | None = None) -> dict[str, object]:
        """Publish (or rename and republish at once) our mesh; :class:`NotMeshOwner` on a non-owner."""
        if self.mesh_key is None:
            raise NotMeshOwner("only the node holding the mesh key can publish the mesh")
        async with self._lock:
            if self.publisher is None:
                publisher = Publisher(
                    self.mesh_key, self.node_key, self.node_id, self.facts, quic_port=self.quic_port,
                    dht=await self._ensure_dht(), lan=lan_scope(self.host), listing_host=self._bind_host(),
                    ttl_s=self.listing_ttl_s,
                )
                await publisher.start(name or self.node_name)
                self.publisher = publisher
            else:
                await self.publisher.rename(name or self.publisher.name)
        info = self.publish_info()
        self.on_event("published", mesh_id=info["mesh_id"], name=info["name"], dht=info["dht"], lan=info["lan"])
        return info

    async def unpublish(self) -> dict[str, object]:
        """Stop publishing (idempotent); the DHT's copies expire within one listing TTL."""
        async with self._lock:
            publisher, self.publisher = self.publisher, None
            if publisher is not None:
                await publisher.stop()
                self.on_event("unpublished", mesh_id=publisher.mesh_key.mesh_id, ttl_s=publisher.ttl_s)
        return self.publish_info()

    def publish_info(self) -> dict[str, object]:
        """``GET /api/publish``: whether and how this node publishes its mesh."""
        publisher = self.publisher
        listing = publisher.listing if publisher is not None else None
        return {
            "published": listing is not None,
            "mesh_id": self.mesh_key.mesh_id if self.mesh_key is not None else None,
            "name": listing.name if listing is not None else None,
            "models": list(listing.models_served) if listing is not None else [],
            "node_count": listing.node_count if listing is not None else 0,
            "expires": listing.expires if listing is not None else None,
            "ttl_s": self.listing_ttl_s,
            "dht": publisher is not None and publisher.dht is not None,
            "lan": publisher is not None and publisher.advertising,
        }

    def dht_info(self) -> dict[str, object]:
        """``GET /api/dht``: this node's DHT multiaddrs (what `discover` uses as its bootstrap)."""
        return {"running": self.dht is not None, "multiaddrs": self._dialable(), "error": self.dht_error or None}

    async def _ensure_dht(self) -> DhtNode | None:
        if self.dht is not None:
            return self.dht
        dht = DhtNode(host=self._bind_host(), server=True)
        try:
            await dht.start(self.dht_port or 0, bootstrap=self.dht_bootstrap)
        except MeshllmError as exc:
            self.dht_error = str(exc)
            log.warning("DHT unavailable, publishing on the LAN only: %s", exc)
            self.on_event("dht_failed", error=str(exc))
            return None
        self.dht, self.dht_error = dht, ""
        self.on_event("dht_ready", multiaddrs=self._dialable())
        return dht

    def _bind_host(self) -> str:
        return "0.0.0.0" if self.host in ("", "::") else self.host

    def _dialable(self) -> list[str]:
        """Our multiaddrs, with a wildcard listen address replaced by this machine's LAN addresses."""
        if self.dht is None:
            return []
        out: list[str] = []
        for addr in self.dht.multiaddrs:
            if "/ip4/0.0.0.0/" in addr:
                out.extend(addr.replace("/ip4/0.0.0.0/", f"/ip4/{ip}/") for ip in lan_addresses() if "." in ip)
            else:
                out.append(addr)
        return out
