"""Signed envelopes: each rejection rule raises its own error and leaves the replay cache alone."""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from identity_strategies import random_or_mutated
from nacl.exceptions import CryptoError
from nacl.public import Box
from nacl.signing import VerifyKey

from meshllm.errors import (
    BadSignature,
    DecodeError,
    NonceReused,
    ReplayedEnvelope,
    StaleTimestamp,
    VerificationError,
    WrongKind,
)
from meshllm.identity.envelope import (
    Envelope,
    EnvelopeReceiver,
    WrongRecipient,
    decode_envelope,
    seal,
)
from meshllm.identity.keys import NodeKey

NOW = 1_800_000_000.0
ALICE, BOB, EVE = NodeKey.ephemeral(), NodeKey.ephemeral(), NodeKey.ephemeral()
NONCE = b"n" * 16


def _edit(data: bytes, **fields: object) -> bytes:
    return msgspec.msgpack.encode(msgspec.structs.replace(decode_envelope(data), **fields))


def test_plain_envelope_is_accepted() -> None:
    opened = EnvelopeReceiver(BOB).open(seal(ALICE, "ping", b"hello", NOW), "ping", NOW + 1)
    assert (opened.kind, opened.sender, opened.payload, opened.encrypted) == ("ping", ALICE.node_id, b"hello", False)
    assert opened.ts_ms == int(NOW * 1000)


def test_plain_envelope_needs_no_receiver_key() -> None:
    assert EnvelopeReceiver().open(seal(ALICE, "ping", b"x", NOW), "ping", NOW).payload == b"x"


def test_encrypted_envelope_reaches_only_its_recipient() -> None:
    data = seal(ALICE, "secret", b"for bob", NOW, recipient=BOB.node_id)
    assert b"for bob" not in data
    opened = EnvelopeReceiver(BOB).open(data, "secret", NOW)
    assert opened.payload == b"for bob" and opened.encrypted
    with pytest.raises(WrongRecipient):
        EnvelopeReceiver(EVE).open(data, "secret", NOW)
    with pytest.raises(WrongRecipient):
        EnvelopeReceiver().open(data, "secret", NOW)


def test_wrong_recipient_cannot_decrypt_even_ignoring_the_address() -> None:
    payload = decode_envelope(seal(ALICE, "secret", b"for bob", NOW, recipient=BOB.node_id)).payload
    eve_box = Box(EVE.signing_key.to_curve25519_private_key(), VerifyKey(ALICE.public).to_curve25519_public_key())
    with pytest.raises(CryptoError):
        eve_box.decrypt(payload)


def test_re_addressing_breaks_the_signature() -> None:
    data = _edit(seal(ALICE, "secret", b"x", NOW, recipient=BOB.node_id), recipient=EVE.public)
    with pytest.raises(BadSignature):
        EnvelopeReceiver(EVE).open(data, "secret", NOW)


def test_wrong_kind() -> None:
    with pytest.raises(WrongKind):
        EnvelopeReceiver(BOB).open(seal(ALICE, "ping", b"", NOW), "down-notice", NOW)


def test_wrong_version_is_a_decode_error() -> None:
    with pytest.raises(DecodeError, match="version 2"):
        EnvelopeReceiver(BOB).open(_edit(seal(ALICE, "ping", b"", NOW), v=2), "ping", NOW)


@pytest.mark.parametrize("field", ["payload", "kind", "ts_ms", "nonce", "sig", "sender"])
def test_tampering_with_any_field_is_bad_signature(field: str) -> None:
    env = decode_envelope(seal(ALICE, "ping", b"hello", NOW))
    changed = {"payload": b"HELLO", "kind": "pong", "ts_ms": env.ts_ms + 1, "nonce": b"m" * 16,
               "sig": bytes(64), "sender": EVE.public}[field]
    data = msgspec.msgpack.encode(msgspec.structs.replace(env, **{field: changed}))
    with pytest.raises(BadSignature):
        EnvelopeReceiver(BOB).open(data, "pong" if field == "kind" else "ping", NOW)


@pytest.mark.parametrize("offset_s", [-60.001, 60.001, -3600, 3600])
def test_stale_or_future_timestamp(offset_s: float) -> None:
    data = seal(ALICE, "ping", b"", NOW)
    with pytest.raises(StaleTimestamp):
        EnvelopeReceiver(BOB).open(data, "ping", NOW - offset_s)


@pytest.mark.parametrize("offset_s", [-60, 60])
def test_timestamp_at_the_window_edge_is_accepted(offset_s: float) -> None:
    EnvelopeReceiver(BOB).open(seal(ALICE, "ping", b"", NOW), "ping", NOW - offset_s)


def test_replayed_envelope() -> None:
    receiver = EnvelopeReceiver(BOB)
    data = seal(ALICE, "ping", b"", NOW)
    receiver.open(data, "ping", NOW)
    with pytest.raises(ReplayedEnvelope):
        receiver.open(data, "ping", NOW + 30)
    assert len(receiver) == 1


def test_reused_nonce() -> None:
    receiver = EnvelopeReceiver(BOB)
    receiver.open(seal(ALICE, "ping", b"one", NOW, nonce=NONCE), "ping", NOW)
    with pytest.raises(NonceReused):
        receiver.open(seal(ALICE, "ping", b"two", NOW + 1, nonce=NONCE), "ping", NOW + 1)
    # Another sender may use the same nonce: nonces are per sender.
    assert receiver.open(seal(EVE, "ping", b"eve", NOW, nonce=NONCE), "ping", NOW).payload == b"eve"


def test_nonce_is_free_again_once_the_old_envelope_is_stale() -> None:
    receiver = EnvelopeReceiver(BOB)
    old = seal(ALICE, "ping", b"one", NOW, nonce=NONCE)
    receiver.open(old, "ping", NOW)
    assert receiver.open(seal(ALICE, "ping", b"two", NOW + 61, nonce=NONCE), "ping", NOW + 61).payload == b"two"
    with pytest.raises(StaleTimestamp):
        receiver.open(old, "ping", NOW + 61)


def test_rejected_envelopes_change_nothing() -> None:
    receiver = EnvelopeReceiver(BOB)
    receiver.open(seal(ALICE, "ping", b"", NOW, nonce=b"a" * 16), "ping", NOW)
    fresh = seal(ALICE, "ping", b"", NOW, nonce=NONCE)
    forged_same_nonce = _edit(seal(ALICE, "ping", b"x", NOW, nonce=b"a" * 16), payload=b"y")
    for data, kind, now, error in [
        (fresh, "other", NOW, WrongKind),
        (fresh, "ping", NOW + 120, StaleTimestamp),
        (_edit(fresh, payload=b"forged"), "ping", NOW, BadSignature),
        (forged_same_nonce, "ping", NOW, BadSignature),  # a forgery cannot claim "nonce reused"
        (seal(ALICE, "ping", b"", NOW, recipient=EVE.node_id, nonce=NONCE), "ping", NOW, WrongRecipient),
        (b"\xc1", "ping", NOW, DecodeError),
    ]:
        with pytest.raises(error):
            receiver.open(data, kind, now)
        assert len(receiver) == 1
    assert receiver.open(fresh, "ping", NOW).payload == b""  # its nonce was never consumed
    assert len(receiver) == 2


def test_cache_evicts_expired_entries() -> None:
    receiver = EnvelopeReceiver(BOB)
    for i in range(5):
        receiver.open(seal(ALICE, "ping", b"", NOW + i), "ping", NOW + i)
    assert len(receiver) == 5
    receiver.open(seal(ALICE, "ping", b"", NOW + 100), "ping", NOW + 100)
    assert len(receiver) == 1


def test_full_cache_stays_bounded_and_refuses_what_it_forgot() -> None:
    receiver = EnvelopeReceiver(BOB, max_entries=3)
    sent = [seal(ALICE, "ping", bytes([i]), NOW + i) for i in range(5)]
    for i, data in enumerate(sent):
        receiver.open(data, "ping", NOW + i)
        assert len(receiver) <= 3
    with pytest.raises(StaleTimestamp, match="cache"):  # forgotten early: refused, never replayed
        receiver.open(sent[0], "ping", NOW + 5)
    with pytest.raises(ReplayedEnvelope):
        receiver.open(sent[4], "ping", NOW + 5)
    # Envelopes newer than the forgotten ones are still welcome.
    receiver.open(seal(ALICE, "ping", b"new", NOW + 5), "ping", NOW + 5)


def test_seal_refuses_bad_nonce_length() -> None:
    with pytest.raises(ValueError, match="nonce"):
        seal(ALICE, "ping", b"", NOW, nonce=b"short")


def test_envelope_struct_has_the_documented_fields() -> None:
    assert Envelope.__struct_fields__ == ("v", "kind", "sender", "recipient", "ts_ms", "nonce", "payload", "sig")


_VALID = [seal(ALICE, "ping", b"hello", NOW), seal(ALICE, "ping", b"to bob", NOW, recipient=BOB.node_id)]


@settings(max_examples=2000, deadline=None)
@given(random_or_mutated(_VALID))
def test_decoder_raises_only_typed_errors_and_accepts_only_valid(data: bytes) -> None:
    receiver = EnvelopeReceiver(BOB)
    try:
        opened = receiver.open(data, "ping", NOW)
    except (DecodeError, VerificationError):
        assert len(receiver) == 0
        return
    assert opened.payload in (b"hello", b"to bob")  # only re-encodings of a valid envelope get through


def test_receiver_refuses_nonsense_limits() -> None:
    with pytest.raises(ValueError, match="window"):
        EnvelopeReceiver(BOB, max_entries=0)


def test_forgery_reusing_an_accepted_signature_is_bad_signature_not_replay() -> None:
    receiver = EnvelopeReceiver(BOB)
    data = seal(ALICE, "ping", b"real", NOW)
    receiver.open(data, "ping", NOW)
    with pytest.raises(BadSignature):
        receiver.open(_edit(data, payload=b"fake"), "ping", NOW)
    with pytest.raises(ReplayedEnvelope):
        receiver.open(data, "ping", NOW)


def test_replay_at_the_last_fresh_instant_is_still_caught() -> None:
    receiver = EnvelopeReceiver(BOB)
    data = seal(ALICE, "ping", b"", NOW)
    receiver.open(data, "ping", NOW + 60)
    with pytest.raises(ReplayedEnvelope):
        receiver.open(data, "ping", NOW + 60)
    receiver.open(seal(ALICE, "ping", b"", NOW + 60), "ping", NOW + 60)  # eviction must keep it too
    with pytest.raises(ReplayedEnvelope):
        receiver.open(data, "ping", NOW + 60)


_POOL = [seal(sender, "ping", bytes([i]), NOW + 20 * (i % 4), nonce=bytes([i % 3]) * 16)
         for i, sender in enumerate([ALICE, EVE] * 4)]


@settings(max_examples=500, deadline=None)
@given(st.lists(st.tuples(st.integers(0, len(_POOL) - 1), st.integers(0, 30_000)), max_size=30),
       st.integers(1, 4))
def test_no_envelope_is_ever_accepted_twice(steps: list[tuple[int, int]], cap: int) -> None:
    receiver = EnvelopeReceiver(BOB, max_entries=cap)
    now, accepted = NOW - 30, set()
    for index, advance_ms in steps:
        now += advance_ms / 1000  # time only moves forward
        try:
            receiver.open(_POOL[index], "ping", now)
        except (StaleTimestamp, ReplayedEnvelope, NonceReused):
            continue
        finally:
            assert len(receiver) <= cap
        assert index not in accepted
        accepted.add(index)
