"""Mesh listings: what a published mesh tells strangers about itself (sans-IO; ``now`` is passed in).

A listing is signed by the **mesh key**, so whoever relays it (a DHT peer, an mDNS responder, a
cache) cannot change it: a reader needs nothing but the mesh id it looks for, because the mesh id
is the hash of the key that signed. Listings are short-lived (:data:`LISTING_TTL_S`) and
republished every :data:`REPUBLISH_INTERVAL_S`, so a mesh that stops publishing (or dies) drops
out of discovery within one TTL without anyone having to delete anything.

Verification is one pure function, :func:`verify_listing`, shared by every transport: bytes in,
a :class:`MeshListing` or a typed error out.
"""

from __future__ import annotations

import logging
from typing import Annotated

import msgspec
from nacl.signing import SigningKey

from meshllm.errors import DecodeError, Expired, VerificationError, WrongMesh
from meshllm.identity.signing import decode_signed, encode_signed, sign, verify
from meshllm.mesh.admission import (
    CLOCK_SKEW_S,
    Invite,
    MeshKey,
    decode_token,
    encode_token,
    mesh_id_for,
    verify_invite,
)

LISTING_DOMAIN = "mesh-listing"
LISTING_TTL_S = 120.0
"""A listing's lifetime: two republish intervals, so one lost republish does not hide a mesh."""
REPUBLISH_INTERVAL_S = 60.0
MAX_LISTING_TTL_S = 3600.0
"""Longest lifetime a reader accepts: bounds how long a stale or replayed listing can circulate."""
MAX_LISTING_BYTES = 32 * 1024
"""Cap on an encoded listing (fits a DHT record and one QUIC frame with room to spare)."""
OPEN_INVITE_TTL_S = 7 * 86400.0
"""Default lifetime of a published mesh's open invite; republishing renews it before it runs out."""

Name = Annotated[str, msgspec.Meta(max_length=64)]
Short = Annotated[str, msgspec.Meta(max_length=256)]
Token = Annotated[str, msgspec.Meta(max_length=8192)]
Count = Annotated[int, msgspec.Meta(ge=0, le=2**53)]


class Capacity(msgspec.Struct, array_like=True, frozen=True):
    """What the mesh can offer, summed over its members (a hint for choosing a mesh, not a promise)."""

    ram_bytes: Count = 0
    """Memory usable for models, summed over nodes."""
    vram_bytes: Count = 0
    """GPU memory summed over nodes."""
    gpu_nodes: Count = 0
    """Members with at least one GPU."""
    tokens_per_s: Annotated[float, msgspec.Meta(ge=0)] = 0.0
    """Measured generation speed summed over serving nodes (0: unknown)."""


class MeshListing(msgspec.Struct, array_like=True, frozen=True):
    """What the mesh key signs (domain ``mesh-listing``) to advertise a published mesh."""

    mesh_id: str
    """The mesh; must be the id of the key that signed the listing."""
    name: Name
    """Human-readable name chosen by the owner (not unique, not trusted for anything)."""
    open_invite: Token
    """Token of an unlimited-use invite signed by the same mesh key: how strangers join."""
    bootstrap: Annotated[list[Short], msgspec.Meta(max_length=32)]
    """``host:port`` QUIC addresses of members to dial."""
    models_served: Annotated[list[Short], msgspec.Meta(max_length=64)]
    models_wanted: Annotated[list[Short], msgspec.Meta(max_length=64)]
    node_count: Count
    capacity: Capacity
    issued: float
    """Unix time of signing; a reader prefers the newest of two listings of one mesh."""
    expires: float
    """Unix time after which readers ignore the listing."""


def new_open_invite(mesh_key: MeshKey, bootstrap: list[str], now: float, ttl_s: float = OPEN_INVITE_TTL_S) -> str:
    """Token of an unlimited-use invite for a published mesh (anyone holding it may join)."""
    return encode_token(mesh_key.invite(now, ttl_s, max_uses=0, bootstrap=bootstrap))


def make_listing(
    mesh_key: MeshKey | SigningKey,
    *,
    name: str,
    open_invite: str,
    bootstrap: list[str],
    now: float,
    models_served: list[str] | None = None,
    models_wanted: list[str] | None = None,
    node_count: int = 1,
    capacity: Capacity | None = None,
    ttl_s: float = LISTING_TTL_S,
) -> bytes:
    """Sign a listing valid from ``now`` for ``ttl_s`` seconds; returns its wire bytes."""
    key = mesh_key.signing_key if isinstance(mesh_key, MeshKey) else mesh_key
    listing = MeshListing(
        mesh_id=mesh_id_for(bytes(key.verify_key)), name=name, open_invite=open_invite,
        bootstrap=list(bootstrap), models_served=list(models_served or []),
        models_wanted=list(models_wanted or []), node_count=node_count, capacity=capacity or Capacity(),
        issued=now, expires=now + ttl_s,
    )
    raw = encode_signed(sign(key, LISTING_DOMAIN, listing))
    verify_listing(raw, now)  # refuse to publish what readers would refuse
    return raw


def verify_listing(raw: bytes, now: float, expected_mesh_id: str | None = None) -> MeshListing:
    """Check a listing from anywhere and decode it.

    Raises, each as its own type: :class:`DecodeError` (malformed, oversized, or a lifetime
    readers refuse), :class:`~meshllm.errors.WrongDomain` / :class:`~meshllm.errors.BadSignature`
    (not a listing, or forged/tampered), :class:`WrongMesh` (the signing key is not the listed
    mesh's, the open invite is for another mesh, or the mesh is not ``expected_mesh_id``) and
    :class:`Expired` (the listing or its open invite is no longer, or not yet, valid).
    """
    if not isinstance(raw, bytes | bytearray | memoryview) or len(raw) > MAX_LISTING_BYTES:
        raise DecodeError(f"a mesh listing is at most {MAX_LISTING_BYTES} bytes")
    signed = decode_signed(bytes(raw), "mesh listing")
    listing = verify(signed, LISTING_DOMAIN, MeshListing)
    if mesh_id_for(signed.signer) != listing.mesh_id:
        raise WrongMesh(f"listing names {listing.mesh_id} but is signed by the key of {mesh_id_for(signed.signer)}")
    if expected_mesh_id is not None and listing.mesh_id != expected_mesh_id:
        raise WrongMesh(f"listing is for {listing.mesh_id}, expected {expected_mesh_id}")
    if not 0 < listing.expires - listing.issued <= MAX_LISTING_TTL_S:
        raise DecodeError(f"listing of {listing.mesh_id} has a lifetime outside (0, {MAX_LISTING_TTL_S:.0f}] s")
    if now >= listing.expires:
        raise Expired(f"listing of {listing.mesh_id} expired {now - listing.expires:.0f} s ago",
                      hint="the mesh stopped publishing; look it up again later")
    if now + CLOCK_SKEW_S < listing.issued:
        raise Expired(f"listing of {listing.mesh_id} is not valid yet (check the clocks)")
    invite = _open_invite(listing, signed.signer)
    if now >= invite.expires:
        raise Expired(f"the open invite of {listing.mesh_id} expired", hint="the mesh owner must publish again")
    return listing


def open_invite_of(listing: MeshListing) -> Invite:
    """The listing's open invite, decoded (call only on a listing :func:`verify_listing` returned)."""
    return verify_invite(decode_token(listing.open_invite).invite)


def _open_invite(listing: MeshListing, mesh_pub: bytes) -> Invite:
    invite = open_invite_of(listing)
    if invite.mesh_pub != mesh_pub or invite.mesh_id != listing.mesh_id:
        raise WrongMesh(f"the open invite in the listing of {listing.mesh_id} is for {invite.mesh_id}")
    if invite.max_uses != 0:
        raise DecodeError(f"the invite in the listing of {listing.mesh_id} is not an open (unlimited) invite")
    return invite



def log_refused(log: logging.Logger, source: str, exc: BaseException) -> None:
    """Log a listing that was dropped: forged, malformed or wrong-mesh ones as warnings (someone
    is serving bad data), expired ones and transport failures as info (routine)."""
    bad = isinstance(exc, DecodeError | VerificationError) and not isinstance(exc, Expired)
    log.log(logging.WARNING if bad else logging.INFO, "ignoring a mesh listing from %s: %s (%s)",
            source, exc, type(exc).__name__)
