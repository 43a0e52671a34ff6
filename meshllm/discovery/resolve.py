"""Finding published meshes as a reader (``meshllm discover`` and ``meshllm join <mesh-id>``).

Two sources, each yielding only listings that passed :func:`~meshllm.discovery.listing.verify_listing`:

* the LAN: mDNS candidates (:func:`~meshllm.discovery.mdns.browse`), whose signed listings are
  fetched over QUIC from a throwaway endpoint;
* the DHT: a short-lived client-mode :class:`~meshllm.discovery.dht.DhtNode` started from the
  bootstrap multiaddrs, asked for one mesh (``get_listing``) or for every published one
  (``find_meshes``).

``interfaces`` follows :func:`~meshllm.discovery.publisher.lan_scope`: ``None`` skips mDNS, ``[]``
browses every interface, ``[ip, ...]`` only those. Listings that fail verification are dropped and
logged: forgeries and wrong-mesh answers as warnings, merely expired ones as info.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

from meshllm.discovery.dht import DhtNode
from meshllm.discovery.listing import MeshListing, log_refused
from meshllm.discovery.mdns import Candidate, browse
from meshllm.discovery.quic_listing import fetch_listing, listing_client
from meshllm.errors import MeshllmError

log = logging.getLogger(__name__)

FETCH_TIMEOUT_S = 3.0
LAN_ROUND_S = 1.5
"""One mDNS browse round while looking for a single mesh (stop at the first round that finds it)."""

Browse = Callable[..., Awaitable[list[Candidate]]]


@dataclass(frozen=True)
class Found:
    """A verified listing and where it was found (``lan``, ``dht`` or ``lan+dht``)."""

    listing: MeshListing
    via: str


class NothingFound(MeshllmError):
    """No live, valid listing of the mesh was found in time."""


async def fetch_candidates(candidates: Sequence[Candidate], *, mesh_id: str | None = None,
                           interfaces: list[str] | None = None,
                           timeout: float = FETCH_TIMEOUT_S) -> list[MeshListing]:
    """Fetch and verify each candidate's listing (all at once); failures are logged and skipped."""
    wanted = [c for c in candidates if mesh_id is None or c.mesh_id == mesh_id]
    if not wanted:
        return []
    host = interfaces[0] if interfaces else "0.0.0.0"
    async with listing_client(host) as client:
        results = await asyncio.gather(*(
            fetch_listing(client, (c.addr, c.port), timeout, expected_mesh_id=c.mesh_id, expected_node_id=c.node_id)
            for c in wanted
        ), return_exceptions=True)
    listings = []
    for cand, result in zip(wanted, results, strict=True):
        if isinstance(result, MeshListing):
            listings.append(result)
        elif isinstance(result, Exception):
            log_refused(log, f"{cand.addr}:{cand.port} (mDNS, {cand.mesh_id})", result)
    return listings


async def lan_find(mesh_id: str, interfaces: list[str], timeout: float,
                   browse_fn: Browse = browse) -> MeshListing | None:
    """Browse in short rounds until ``mesh_id`` shows up with a valid listing, or ``timeout`` passes."""
    deadline = time.monotonic() + timeout
    while (left := deadline - time.monotonic()) > 0.2:
        candidates = await browse_fn(min(LAN_ROUND_S, left), interfaces=interfaces or None)
        found = await fetch_candidates(candidates, mesh_id=mesh_id, interfaces=interfaces,
                                       timeout=min(FETCH_TIMEOUT_S, max(0.5, deadline - time.monotonic())))
        if found:
            return max(found, key=lambda item: item.issued)
    return None


async def lan_all(interfaces: list[str], timeout: float, browse_fn: Browse = browse) -> list[MeshListing]:
    """Every mesh advertised on the LAN: browse for most of ``timeout``, then fetch the listings."""
    candidates = await browse_fn(max(0.5, timeout * 0.6), interfaces=interfaces or None)
    fetch_s = max(0.5, min(FETCH_TIMEOUT_S, timeout * 0.4))
    return await fetch_candidates(candidates, interfaces=interfaces, timeout=fetch_s)


async def dht_lookup(bootstrap: Sequence[str], timeout: float, mesh_id: str | None = None) -> list[MeshListing]:
    """One mesh's listing (``mesh_id``) or every published mesh's, through a short-lived DHT client.

    Raises :class:`~meshllm.discovery.dht.DhtError` when libp2p is missing or no bootstrap peer answers.
    """
    deadline = time.monotonic() + timeout
    node = DhtNode(host=_client_host(bootstrap), server=False)
    await node.start(bootstrap=bootstrap, timeout=max(1.0, timeout * 0.5))
    try:
        left = max(1.0, deadline - time.monotonic())
        if mesh_id is not None:
            listing = await node.get_listing(mesh_id, timeout=left / 2)
            if listing is not None:
                return [listing]
            left = max(1.0, deadline - time.monotonic())
            return [item for item in await node.find_meshes(timeout=left) if item.mesh_id == mesh_id]
        return await node.find_meshes(timeout=left)
    finally:
        await node.stop()


async def find_listing(mesh_id: str, *, interfaces: list[str] | None, bootstrap: Sequence[str],
                       timeout: float) -> Found:
    """The mesh's listing: the LAN first, then the DHT. :class:`NothingFound` names what was tried."""
    if interfaces is None and not bootstrap:
        raise NothingFound(f"cannot look up {mesh_id}: no LAN to browse and no DHT bootstrap peer",
                           hint="pass --dht-bootstrap MULTIADDR (or set $MESHLLM_DHT_BOOTSTRAP or dht_bootstrap in "
                                "config.toml)")
    deadline = time.monotonic() + timeout
    tried = []
    if interfaces is not None:
        lan_budget = min(4.0, timeout / 2) if bootstrap else timeout
        listing = await lan_find(mesh_id, interfaces, lan_budget)
        if listing is not None:
            return Found(listing, "lan")
        tried.append("the LAN (mDNS)")
    if bootstrap:
        try:
            found = await dht_lookup(bootstrap, max(1.0, deadline - time.monotonic()), mesh_id)
        except MeshllmError as exc:
            tried.append(f"the DHT ({exc})")
        else:
            if found:
                return Found(found[0], "dht")
            tried.append("the DHT")
    raise NothingFound(f"no live listing of {mesh_id} found on {' or '.join(tried)} within {timeout:g} s",
                       hint="check the mesh id, and that its owner still runs `meshllm publish`")


async def discover_all(*, interfaces: list[str] | None, bootstrap: Sequence[str],
                       timeout: float) -> tuple[list[Found], list[str]]:
    """Every published mesh found on the LAN and in the DHT (newest listing per mesh), plus notes on
    sources that could not be searched."""
    notes: list[str] = []

    async def lan() -> list[MeshListing]:
        return [] if interfaces is None else await lan_all(interfaces, timeout)

    async def dht() -> list[MeshListing]:
        if not bootstrap:
            notes.append("DHT not searched: no bootstrap peer (pass --dht-bootstrap, set dht_bootstrap in "
                         "config.toml, or run a node with a DHT here)")
            return []
        try:
            return await dht_lookup(bootstrap, timeout)
        except MeshllmError as exc:
            notes.append(f"DHT not searched: {exc}")
            return []

    on_lan, in_dht = await asyncio.gather(lan(), dht())
    return merge(on_lan, in_dht), notes


def rank(found: Sequence[Found], wanted: Sequence[str]) -> list[Found]:
    """Meshes best first for a node that wants ``wanted`` models (names, matched as substrings either way):
    those serving one, then those asking for one (their listing's ``models_wanted``), then the rest;
    within each, the most tokens a second, then the most nodes, then the newest listing."""
    keys = [w.lower() for w in wanted if w]

    def matches(names: Sequence[str]) -> bool:
        return any(k in n.lower() or n.lower() in k for k in keys for n in names if n)

    def score(item: Found) -> tuple[int, float, int, float]:
        listing = item.listing
        fit = 0 if matches(listing.models_served) else 1 if matches(listing.models_wanted) else 2
        return fit, -listing.capacity.tokens_per_s, -listing.node_count, -listing.issued

    return sorted(found, key=score)


async def auto_find(wanted: Sequence[str], *, interfaces: list[str] | None, bootstrap: Sequence[str],
                    timeout: float, source: str = "") -> Found:
    """The best published mesh for ``wanted`` on the LAN and in the DHT (every listing verified).

    Raises :class:`NothingFound` naming what was searched when no mesh is published there.
    """
    found, notes = await discover_all(interfaces=interfaces, bootstrap=bootstrap, timeout=timeout)
    ranked = rank(found, wanted)
    if ranked:
        return ranked[0]
    searched = [w for w, on in (("the LAN", interfaces is not None), (f"the DHT (via {source or 'bootstrap'})",
                                                                       bool(bootstrap))) if on]
    raise NothingFound(f"no published mesh found on {' or '.join(searched) or 'nothing'} within {timeout:g} s",
                       hint="; ".join(notes) or "set $MESHLLM_DHT_BOOTSTRAP or dht_bootstrap in config.toml to a DHT "
                                                "where meshes are published, or join with an invite")


def merge(on_lan: Sequence[MeshListing], in_dht: Sequence[MeshListing]) -> list[Found]:
    """Newest listing per mesh, tagged with every source that had one; sorted by name then id."""
    best: dict[str, MeshListing] = {}
    sources: dict[str, set[str]] = {}
    for via, listings in (("lan", on_lan), ("dht", in_dht)):
        for listing in listings:
            sources.setdefault(listing.mesh_id, set()).add(via)
            if listing.mesh_id not in best or listing.issued > best[listing.mesh_id].issued:
                best[listing.mesh_id] = listing
    found = [Found(listing, "+".join(sorted(sources[mid], key=["lan", "dht"].index))) for mid, listing in best.items()]
    return sorted(found, key=lambda item: (item.listing.name, item.listing.mesh_id))


def _client_host(bootstrap: Sequence[str]) -> str:
    """Listen on loopback when every bootstrap peer is local (tests, one machine), else everywhere."""
    return "127.0.0.1" if bootstrap and all(a.startswith("/ip4/127.") for a in bootstrap) else "0.0.0.0"

