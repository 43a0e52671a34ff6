"""Mesh listings: signing, every refusal as its own typed error, and a fuzzed decoder."""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from meshllm.discovery.listing import (
    LISTING_TTL_S,
    MAX_LISTING_TTL_S,
    Capacity,
    MeshListing,
    make_listing,
    new_open_invite,
    open_invite_of,
    verify_listing,
)
from meshllm.errors import BadSignature, DecodeError, Expired, MeshllmError, WrongDomain, WrongMesh
from meshllm.identity.signing import Signed, decode_signed, encode_signed, sign
from meshllm.mesh.admission import MeshKey, encode_token

NOW = 1_700_000_000.0
KEY = MeshKey.generate()
OTHER = MeshKey.generate()


def listing(key: MeshKey = KEY, now: float = NOW, **changes: object) -> bytes:
    fields: dict[str, object] = dict(
        name="lab", open_invite=new_open_invite(key, ["127.0.0.1:9338"], now), bootstrap=["127.0.0.1:9338"],
        now=now, models_served=["gemma3-270m"], node_count=3, capacity=Capacity(ram_bytes=2**34, gpu_nodes=1),
    )
    fields.update(changes)
    return make_listing(key, **fields)  # type: ignore[arg-type]


def resign(raw: bytes, key: MeshKey = KEY, domain: str = "mesh-listing", **changes: object) -> bytes:
    """Re-sign a listing with ``changes`` applied (bypassing make_listing's own check)."""
    body = msgspec.msgpack.decode(decode_signed(raw).body, type=MeshListing)
    return encode_signed(sign(key.signing_key, domain, msgspec.structs.replace(body, **changes)))


def test_round_trip() -> None:
    got = verify_listing(listing(), NOW + 1, expected_mesh_id=KEY.mesh_id)
    assert got.mesh_id == KEY.mesh_id and got.name == "lab" and got.node_count == 3
    assert got.expires == NOW + LISTING_TTL_S and got.capacity.gpu_nodes == 1
    invite = open_invite_of(got)
    assert invite.max_uses == 0 and invite.mesh_id == KEY.mesh_id


def test_tampered_body_is_a_bad_signature() -> None:
    signed = decode_signed(listing())
    body = bytearray(signed.body)
    body[body.index(b"lab")] ^= 1
    with pytest.raises(BadSignature):
        verify_listing(encode_signed(Signed(signed.domain, signed.signer, bytes(body), signed.sig)), NOW)


def test_other_domain_is_refused() -> None:
    with pytest.raises(WrongDomain):
        verify_listing(resign(listing(), domain="invite"), NOW)


def test_expired_and_not_yet_valid() -> None:
    raw = listing()
    with pytest.raises(Expired):
        verify_listing(raw, NOW + LISTING_TTL_S)
    with pytest.raises(Expired):
        verify_listing(raw, NOW - 3600)


def test_mesh_id_must_be_the_signing_keys() -> None:
    forged = resign(listing(), key=OTHER)  # OTHER signs a listing that names KEY's mesh
    with pytest.raises(WrongMesh):
        verify_listing(forged, NOW)
    with pytest.raises(WrongMesh):
        verify_listing(listing(), NOW, expected_mesh_id=OTHER.mesh_id)


def test_open_invite_must_be_the_meshs_and_unlimited() -> None:
    with pytest.raises(WrongMesh):
        listing(open_invite=new_open_invite(OTHER, [], NOW))
    with pytest.raises(DecodeError):
        listing(open_invite=encode_token(KEY.invite(NOW, 3600, max_uses=1)))
    with pytest.raises(Expired):
        verify_listing(listing(open_invite=new_open_invite(KEY, [], NOW, ttl_s=10)), NOW + 20)


def test_overlong_lifetime_and_oversize_are_malformed() -> None:
    with pytest.raises(DecodeError):
        listing(ttl_s=MAX_LISTING_TTL_S + 1)
    with pytest.raises(DecodeError):
        verify_listing(b"\x00" * 40_000, NOW)
    with pytest.raises(DecodeError):
        listing(name="x" * 65)


VALID = [listing(), listing(key=OTHER, name="other", models_wanted=["qwen"])]


@st.composite
def mutated(draw: st.DrawFn) -> bytes:
    data = bytearray(draw(st.sampled_from(VALID)))
    for _ in range(draw(st.integers(1, 4))):
        how = draw(st.sampled_from(["flip", "truncate", "extend", "splice"]))
        if how == "flip" and data:
            data[draw(st.integers(0, len(data) - 1))] ^= 1 << draw(st.integers(0, 7))
        elif how == "truncate":
            del data[draw(st.integers(0, len(data))):]
        elif how == "extend":
            data += draw(st.binary(min_size=1, max_size=32))
        else:
            start = draw(st.integers(0, len(data)))
            data[start:draw(st.integers(start, len(data)))] = draw(st.binary(max_size=32))
    return bytes(data)


@settings(max_examples=2000, deadline=None)
@given(st.one_of(st.binary(max_size=600), mutated()))
def test_decoder_fuzz_raises_only_typed_errors(data: bytes) -> None:
    try:
        got = verify_listing(data, NOW + 1)
    except MeshllmError:
        return
    # Only a valid listing's content is ever accepted (msgspec tolerates trailing extra fields in
    # the Signed array, so the bytes may differ; what was signed may not).
    assert got in [verify_listing(v, NOW + 1) for v in VALID]
