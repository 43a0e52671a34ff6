"""Fetching a mesh's signed listing over QUIC from a node we are not (yet) a member of.

The mesh endpoint admits only members (its ``admit`` callback checks a membership proof), and a
stranger has none. So a node that publishes on the LAN serves its listing on a **separate,
listing-only endpoint** (same node key, its own UDP port) that admits anyone with an empty proof
and serves one stream kind, ``listing``. The listing needs no transport trust: it is signed by
the mesh key and checked with :func:`~meshllm.discovery.listing.verify_listing`; TLS still proves
the node id the mDNS record announced. The reader dials from a throwaway endpoint that presents
an empty proof and accepts any peer (it serves no stream kinds at all).

Exchange on one ``listing`` stream: ``ListingRequest{mesh_id}`` -> ``ListingReply{listing}``
(empty bytes when the node does not publish that mesh).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable

import msgspec
from nacl.signing import SigningKey

from meshllm.discovery.listing import MAX_LISTING_BYTES, MeshListing, verify_listing
from meshllm.errors import MeshllmError
from meshllm.net.connection import PeerConnection
from meshllm.net.endpoint import Endpoint, EndpointOptions
from meshllm.net.messages import Addr
from meshllm.net.streams import Stream

LISTING_STREAM = "listing"
LISTING_FRAME_MAX = MAX_LISTING_BYTES + 1024
LISTING_ENDPOINT_OPTIONS = EndpointOptions(idle_timeout=10.0, admission_timeout=3.0, max_pending=32)
"""Strangers get short-lived connections and a small handshake budget."""


class ListingRequest(msgspec.Struct, frozen=True):
    """Reader -> publisher: which mesh's listing it wants."""

    mesh_id: str


class ListingReply(msgspec.Struct, frozen=True):
    """Publisher -> reader: the signed listing bytes, or empty when it does not publish that mesh."""

    listing: bytes


class NoListing(MeshllmError):
    """The node answered but publishes no (such) listing."""

    hint = "the mesh may have stopped publishing; run `meshllm discover` again"


def _admit_anyone(peer_id: str, proof: bytes, dialer: bool) -> None:
    """Listing endpoints serve only signed, public data: no admission is needed either way."""


class ListingServer:
    """Holds this node's current listings and serves them on ``listing`` streams."""

    def __init__(self) -> None:
        self.listings: dict[str, bytes] = {}
        """mesh id -> current signed listing; replace the value on every republish."""

    def publish(self, raw: bytes, now: float) -> MeshListing:
        """Serve ``raw`` (verified first) from now on, replacing the mesh's previous listing."""
        listing = verify_listing(raw, now)
        self.listings[listing.mesh_id] = bytes(raw)
        return listing

    def unpublish(self, mesh_id: str) -> None:
        self.listings.pop(mesh_id, None)

    async def serve_listing(self, stream: Stream, peer: PeerConnection) -> None:
        """Stream handler for kind ``listing``: one request, one reply."""
        request = await stream.recv(ListingRequest, timeout=5.0)
        if request is None:
            return
        await stream.send(ListingReply(self.listings.get(request.mesh_id, b"")), timeout=5.0)

    async def open_endpoint(self, signing_key: SigningKey, host: str = "0.0.0.0", port: int = 0) -> Endpoint:
        """The listing-only endpoint (close it with ``await endpoint.close()``)."""
        endpoint = await Endpoint.create(
            signing_key, host, port, admit=_admit_anyone, local_proof=lambda: b"", options=LISTING_ENDPOINT_OPTIONS
        )
        endpoint.on_stream(LISTING_STREAM, self.serve_listing, max_frame=LISTING_FRAME_MAX)
        return endpoint


@contextlib.asynccontextmanager
async def listing_client(host: str = "0.0.0.0") -> AsyncIterator[Endpoint]:
    """A throwaway endpoint (fresh key, empty proof) for :func:`fetch_listing`."""
    endpoint = await Endpoint.create(
        SigningKey.generate(), host, 0, admit=_admit_anyone, local_proof=lambda: b"", options=LISTING_ENDPOINT_OPTIONS
    )
    try:
        yield endpoint
    finally:
        await endpoint.close()


async def fetch_listing(
    endpoint: Endpoint,
    addr: Addr,
    timeout: float,
    *,
    expected_mesh_id: str,
    expected_node_id: str | None = None,
    clock: Callable[[], float] = time.time,
) -> MeshListing:
    """Fetch and verify ``expected_mesh_id``'s listing from the listing endpoint at ``addr``.

    ``endpoint`` must present an empty proof (use :func:`listing_client`). Raises the transport's
    :class:`~meshllm.net.ConnectError` / :class:`~meshllm.net.NetTimeout`, :class:`NoListing`, or
    :func:`verify_listing`'s typed errors (a listing for another mesh is :class:`WrongMesh`).
    """
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    # Fetches from one server share its connection (one per peer), so none closes it: the throwaway
    # endpoint of :func:`listing_client` closes them all when its block ends.
    peer = await endpoint.connect(addr, expected_node_id, timeout=timeout)
    stream = await peer.open_stream(LISTING_STREAM, max_frame=LISTING_FRAME_MAX)
    await stream.send(ListingRequest(expected_mesh_id), timeout=max(0.1, deadline - loop.time()))
    reply = await stream.recv(ListingReply, timeout=max(0.1, deadline - loop.time()))
    stream.close()
    if reply is None or not reply.listing:
        raise NoListing(f"{addr[0]}:{addr[1]} publishes no listing of {expected_mesh_id}")
    return verify_listing(reply.listing, clock(), expected_mesh_id)
