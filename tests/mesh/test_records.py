"""Peer record signing and every verification rule, each with its own typed error."""

from __future__ import annotations

import contextlib

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from sim import MESH, make_key, make_record, make_verifier

from meshllm.errors import (
    BadSignature,
    DecodeError,
    InviteRevoked,
    Untrusted,
    VerificationError,
    WrongDomain,
    WrongMesh,
    WrongSigner,
)
from meshllm.identity.signing import CLOCK_SKEW_S, sign
from meshllm.mesh.messages import (
    Digest,
    DownNotice,
    Exchange,
    decode_message,
    encode_message,
    sign_notice,
    verify_notice,
)
from meshllm.mesh.records import (
    MAX_DEMAND,
    RECORD_MAX,
    RECORD_MAX_AGE_S,
    SEQ_LIMIT,
    Capacity,
    DemandEntry,
    ExpiredRecord,
    Models,
    PeerRecord,
    RecordTooLarge,
    RecordVerifier,
    RttEntry,
    SequenceOutOfRange,
    ServedModel,
    SignatureCache,
    StaleRecord,
    decode_record,
    sign_record,
)

KEY = make_key(1)
OTHER = make_key(2)


def full_record(seq: int = 5) -> PeerRecord:
    return make_record(
        KEY,
        seq=seq,
        name="box",
        capacity=Capacity(ram_bytes=1 << 34, vram_bytes=0, cpu_cores=8, gflops=120.5),
        models=Models(served=[ServedModel(name="gemma", context=4096, layer_start=0, layer_end=9)]),
        rtt={make_record(OTHER).node_id: RttEntry(12.5, "direct")},
        owner_cert=b"cert",
        demand=[DemandEntry("llama-70b", 12, 3, 1_800_000_000.5)],
        standby=["gemma"],
    )


def test_roundtrip_preserves_every_field() -> None:
    record = full_record()
    assert make_verifier().verify(sign_record(KEY, record), now=0.0) == record


def test_bad_signature() -> None:
    raw = bytearray(sign_record(KEY, full_record()))
    raw[-3] ^= 1  # inside the signature
    with pytest.raises(BadSignature):
        make_verifier().verify(bytes(raw), now=0.0)


def test_signer_must_be_the_node_id_key() -> None:
    forged = msgspec.msgpack.encode(sign(OTHER, "peer-record", full_record()))
    with pytest.raises(WrongSigner):
        make_verifier().verify(forged, now=0.0)
    with pytest.raises(WrongSigner):
        sign_record(OTHER, full_record())


def test_wrong_domain() -> None:
    raw = msgspec.msgpack.encode(sign(KEY, "invite", full_record()))
    with pytest.raises(WrongDomain):
        make_verifier().verify(raw, now=0.0)


def test_wrong_mesh() -> None:
    verifier = RecordVerifier("another-mesh", lambda *a: None, lambda *a: None)
    with pytest.raises(WrongMesh):
        verifier.verify(sign_record(KEY, full_record()), now=0.0)


def test_forged_membership_proof_is_refused_by_the_callback() -> None:
    def check_member(node: str, proof: bytes, now: float) -> None:
        raise InviteRevoked(f"proof of {node[:8]} names a revoked invite")

    verifier = RecordVerifier(MESH, check_member, lambda *a: None)
    with pytest.raises(InviteRevoked):
        verifier.verify(sign_record(KEY, full_record()), now=0.0)


def test_untrusted_owner_is_refused_by_the_callback() -> None:
    def check_trust(node: str, cert: bytes | None, now: float) -> None:
        raise Untrusted("policy require-owned: no certificate from a trusted owner")

    verifier = RecordVerifier(MESH, lambda *a: None, check_trust)
    with pytest.raises(Untrusted):
        verifier.verify(sign_record(KEY, full_record()), now=0.0)


def test_stale_sequence() -> None:
    raw = sign_record(KEY, full_record(seq=5))
    for held in (5, 6):
        with pytest.raises(StaleRecord):
            make_verifier().verify(raw, now=0.0, held=lambda _n, h=held: h)
    assert make_verifier().verify(raw, now=0.0, held=lambda _n: 4).seq == 5


def test_sequences_are_bounded_on_sign_and_on_the_wire() -> None:
    for seq in (SEQ_LIMIT, 2**64 - 1, -1):
        with pytest.raises(SequenceOutOfRange):
            sign_record(KEY, full_record(seq=seq))
    forged = msgspec.msgpack.encode(sign(KEY, "peer-record", full_record(seq=SEQ_LIMIT)))
    with pytest.raises(DecodeError):
        make_verifier().verify(forged, now=0.0)
    assert make_verifier().verify(sign_record(KEY, full_record(seq=SEQ_LIMIT - 1)), now=0.0).seq == SEQ_LIMIT - 1
    with pytest.raises(DecodeError):
        decode_message(encode_message(Digest({"n": SEQ_LIMIT})))
    assert decode_message(encode_message(Digest({"n": SEQ_LIMIT - 1}))) == Digest({"n": SEQ_LIMIT - 1})
    reporter = make_record(OTHER).node_id
    with pytest.raises(DecodeError):
        verify_notice(sign_notice(OTHER, DownNotice("x", 2**64 - 1, reporter, 1.0)), SignatureCache())


def test_size_cap_on_encode_and_decode() -> None:
    big = make_record(KEY, name="x" * RECORD_MAX)
    with pytest.raises(RecordTooLarge):
        sign_record(KEY, big)
    oversized = msgspec.msgpack.encode(sign(KEY, "peer-record", big))
    with pytest.raises(RecordTooLarge):
        make_verifier().verify(oversized, now=0.0)
    assert issubclass(RecordTooLarge, DecodeError)


def test_signature_cache_only_remembers_successes() -> None:
    cache = SignatureCache(size=2)
    raw = sign_record(KEY, full_record())
    signed, _ = decode_record(raw)
    cache.check(signed, raw)
    cache.check(signed, raw)  # hit
    bad = msgspec.structs.replace(signed, sig=bytes(64))
    with pytest.raises(BadSignature):
        cache.check(bad, raw + b"x")


VALID = sign_record(KEY, full_record())
SAMPLES = [
    VALID,
    encode_message(Exchange([VALID], want=["a", "b"])),
    sign_notice(OTHER, DownNotice(full_record().node_id, 5, make_record(OTHER).node_id, 1.5)),
]
ERRORS = (DecodeError, VerificationError)


def mutate(data: bytes, edits: list[tuple[int, int]]) -> bytes:
    buf = bytearray(data)
    for pos, value in edits:
        buf[pos % len(buf)] = value
    return bytes(buf)


@settings(max_examples=2000, deadline=None)
@given(
    st.one_of(
        st.binary(max_size=512),
        st.tuples(
            st.sampled_from(SAMPLES),
            st.lists(st.tuples(st.integers(0, 10_000), st.integers(0, 255)), min_size=1, max_size=6),
        ).map(lambda t: mutate(*t)),
        st.tuples(st.sampled_from(SAMPLES), st.integers(1, 10_000)).map(lambda t: t[0][: t[1] % len(t[0])]),
    )
)
def test_decoders_raise_only_typed_errors(data: bytes) -> None:
    verifier = make_verifier()
    for decode in (
        lambda d: verifier.verify(d, now=0.0),
        decode_message,
        lambda d: verify_notice(d, SignatureCache()),
    ):
        with contextlib.suppress(ERRORS):
            decode(data)


def test_a_record_is_accepted_only_while_fresh_by_its_signature() -> None:
    v = make_verifier()
    key = make_key(77)
    assert v.verify(sign_record(key, make_record(key, signed_at=1000.0)), now=1000.0 + RECORD_MAX_AGE_S)
    for signed_at in (1000.0 - 1, 1000.0 + RECORD_MAX_AGE_S + CLOCK_SKEW_S + 1):
        with pytest.raises(ExpiredRecord):
            v.verify(sign_record(key, make_record(key, signed_at=signed_at)), now=1000.0 + RECORD_MAX_AGE_S)


@pytest.mark.parametrize("rtt", [float("nan"), float("inf"), -1.0, 1e12])
def test_rtt_rows_must_be_finite_and_plausible(rtt: float) -> None:
    key = make_key(78)
    raw = msgspec.msgpack.encode(sign(key, "peer-record", {**msgspec.structs.asdict(make_record(key)),
                                                          "rtt": {"x": [rtt, "direct"]}}))
    with pytest.raises(DecodeError):
        decode_record(raw)


@pytest.mark.parametrize("field,value", [
    ("demand", [["m", 1, 0, float("nan")]]),
    ("demand", [["m", -1, 0, 1.0]]),
    ("demand", [["x" * 201, 1, 0, 1.0]]),
    ("demand", [["m", 1, 0, 1.0]] * (MAX_DEMAND + 1)),
    ("standby", ["m"] * (MAX_DEMAND + 1)),
])
def test_demand_and_standby_lists_are_bounded(field: str, value: object) -> None:
    """What one peer's demand map and standby list make every member hold is capped at decode."""
    key = make_key(79)
    raw = msgspec.msgpack.encode(sign(key, "peer-record", {**msgspec.structs.asdict(make_record(key)), field: value}))
    with pytest.raises(DecodeError):
        decode_record(raw)
