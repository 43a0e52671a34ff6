"""Trust store: every policy accepts and refuses exactly what docs/identity.md says."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from pathlib import Path

import msgspec
import pytest
from hypothesis import given, settings
from identity_strategies import random_or_mutated

from meshllm.config import TRUST_FILE
from meshllm.errors import (
    BadSignature,
    CertificateExpired,
    CertificateRevoked,
    ConfigError,
    NodeRevoked,
    OwnerRevoked,
    Untrusted,
    VerificationError,
    WrongSubject,
)
from meshllm.identity.certs import certificate_id, issue_certificate
from meshllm.identity.ids import b32
from meshllm.identity.keys import NodeKey
from meshllm.identity.signing import encode_signed
from meshllm.identity.trust import TrustPolicy, TrustStore, decode_trust_file

NOW = 1_800_000_000.0
OWNER = NodeKey.ephemeral()
OWNER_PUB = b32(OWNER.public)
STRANGER = NodeKey.ephemeral()
NODE = NodeKey.ephemeral()


def _cert(owner: NodeKey = OWNER, node: NodeKey = NODE, lifetime: float = 3600) -> bytes:
    return encode_signed(issue_certificate(owner.signing_key, node.node_id, NOW, lifetime, "box"))


def _store(policy: TrustPolicy) -> TrustStore:
    store = TrustStore()
    store.set_policy(policy)
    store.add_owner(OWNER_PUB, "me", now=NOW)
    return store


def _forged() -> bytes:
    data = bytearray(_cert())
    data[-1] ^= 1
    return bytes(data)


@pytest.mark.parametrize("policy", list(TrustPolicy))
def test_revoked_node_is_refused_under_every_policy(policy: TrustPolicy) -> None:
    store = _store(policy)
    store.allow_node(NODE.node_id)
    store.revoke_node(NODE.node_id)
    with pytest.raises(NodeRevoked):
        store.evaluate(NODE.node_id, _cert(), NOW)


@pytest.mark.parametrize("policy", [TrustPolicy.PREFER_OWNED, TrustPolicy.REQUIRE_OWNED, TrustPolicy.ALLOWLIST])
def test_revoked_certificate_and_owner_are_refused(policy: TrustPolicy) -> None:
    store = _store(policy)
    store.allow_node(NODE.node_id)
    cert = _cert()
    store.revoke_certificate(certificate_id(cert))
    with pytest.raises(CertificateRevoked):
        store.evaluate(NODE.node_id, cert, NOW)
    store = _store(policy)
    store.allow_node(NODE.node_id)
    store.revoke_owner(OWNER_PUB)
    assert store.owner(OWNER_PUB) is None
    with pytest.raises(OwnerRevoked):
        store.evaluate(NODE.node_id, cert, NOW)


def test_revoked_beats_expired() -> None:
    store = _store(TrustPolicy.REQUIRE_OWNED)
    cert = _cert(lifetime=60)
    store.revoke_certificate(certificate_id(cert))
    with pytest.raises(CertificateRevoked):
        store.evaluate(NODE.node_id, cert, NOW + 3600)


def test_off_accepts_anyone_and_ignores_certificates() -> None:
    store = _store(TrustPolicy.OFF)
    store.revoke_owner(OWNER_PUB)
    for cert in (None, _cert(), _forged()):
        decision = store.evaluate(NODE.node_id, cert, NOW)
        assert not decision.owned and decision.policy is TrustPolicy.OFF


def test_prefer_owned_marks_owned_peers() -> None:
    decision = _store(TrustPolicy.PREFER_OWNED).evaluate(NODE.node_id, _cert(), NOW)
    assert decision.owned and decision.owner_label == "me" and decision.owner_pub == OWNER.public
    assert decision.certificate is not None and decision.certificate.label == "box"


@pytest.mark.parametrize(("make", "note"), [
    (lambda: None, ""),
    (lambda: _cert(owner=STRANGER), "does not trust"),
    (lambda: _cert(lifetime=1), "expired"),
    (_forged, "does not verify"),
    (lambda: _cert(node=STRANGER), "is for node"),
    (lambda: b"\x00garbage", "malformed"),
])
def test_prefer_owned_accepts_unowned_peers(make: Callable[[], bytes | None], note: str) -> None:
    decision = _store(TrustPolicy.PREFER_OWNED).evaluate(NODE.node_id, make(), NOW + 10)
    assert not decision.owned and note in decision.note


def test_require_owned_accepts_owned_peer() -> None:
    assert _store(TrustPolicy.REQUIRE_OWNED).evaluate(NODE.node_id, _cert(), NOW).owned


@pytest.mark.parametrize(("make", "error"), [
    (lambda: None, Untrusted),
    (lambda: _cert(owner=STRANGER), Untrusted),
    (lambda: _cert(lifetime=1), CertificateExpired),
    (_forged, BadSignature),
    (lambda: _cert(node=STRANGER), WrongSubject),
])
def test_require_owned_refuses_everything_else(make: Callable[[], bytes | None], error: type[Exception]) -> None:
    with pytest.raises(error):
        _store(TrustPolicy.REQUIRE_OWNED).evaluate(NODE.node_id, make(), NOW + 10)


def test_allowlist_accepts_only_listed_nodes() -> None:
    store = _store(TrustPolicy.ALLOWLIST)
    with pytest.raises(Untrusted, match="allowlist"):
        store.evaluate(NODE.node_id, _cert(), NOW)
    store.allow_node(NODE.node_id)
    assert not store.evaluate(NODE.node_id, None, NOW).owned
    assert store.evaluate(NODE.node_id, _cert(), NOW).owned
    assert not store.evaluate(NODE.node_id, _cert(lifetime=1), NOW + 10).owned
    store.disallow_node(NODE.node_id)
    with pytest.raises(Untrusted):
        store.evaluate(NODE.node_id, None, NOW)


def test_store_persists_atomically_and_privately(tmp_path: Path) -> None:
    store = TrustStore.load(tmp_path)
    assert store.data.policy is TrustPolicy.PREFER_OWNED and not store.data.owners
    store.set_policy(TrustPolicy.REQUIRE_OWNED)
    store.add_owner(OWNER_PUB.upper(), "me")
    store.revoke_node(STRANGER.node_id)
    store.revoke_certificate("AB" * 32)
    store.allow_node(NODE.node_id)
    store.save()
    assert (tmp_path / TRUST_FILE).stat().st_mode & 0o777 == 0o600
    again = TrustStore.load(tmp_path)
    assert again.data == store.data
    assert again.owner(OWNER_PUB) is not None and again.data.revoked_certs == ["ab" * 32]
    again.remove_owner(OWNER_PUB)
    assert again.owner(OWNER_PUB) is None


@pytest.mark.parametrize("text", ["{", '{"v": 2}', '{"owners": [{"pub": "short"}]}', '{"policy": "yolo"}',
                                  '{"surprise": 1}', '{"revoked_certs": ["xyz"]}'])
def test_damaged_store_is_a_config_error(tmp_path: Path, text: str) -> None:
    (tmp_path / TRUST_FILE).write_text(text)
    with pytest.raises(ConfigError, match="cannot read trust store"):
        TrustStore.load(tmp_path)


def test_editing_mistakes_are_config_errors() -> None:
    store = _store(TrustPolicy.PREFER_OWNED)
    with pytest.raises(ConfigError, match="not a valid owner key"):
        store.add_owner("nope")
    with pytest.raises(ConfigError, match="not in the trust store"):
        store.remove_owner(b32(STRANGER.public))
    with pytest.raises(ConfigError, match="not a certificate id"):
        store.revoke_certificate("1234")
    with pytest.raises(ConfigError, match="not on the allowlist"):
        store.disallow_node(NODE.node_id)
    store.revoke_owner(OWNER_PUB)
    with pytest.raises(ConfigError, match="revoked"):
        store.add_owner(OWNER_PUB)


def _valid_trust_files() -> list[bytes]:
    store = _store(TrustPolicy.ALLOWLIST)
    store.allow_node(NODE.node_id)
    store.revoke_node(STRANGER.node_id)
    store.revoke_certificate(certificate_id(_cert()))
    return [msgspec.json.encode(store.data), msgspec.json.format(msgspec.json.encode(store.data))]


@settings(max_examples=2000, deadline=None)
@given(random_or_mutated(_valid_trust_files()))
def test_trust_file_decoder_raises_only_config_error(data: bytes) -> None:
    try:
        trust = decode_trust_file(data)
    except ConfigError:
        return
    with contextlib.suppress(VerificationError):  # whatever parsed is usable: decisions, not crashes
        TrustStore(trust).evaluate(NODE.node_id, _cert(), NOW)
