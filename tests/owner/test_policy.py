"""The command gate: which owner commands a node executes, and the typed reason for every refusal."""

from __future__ import annotations

import msgspec
import pytest
from nacl.signing import SigningKey

from meshllm.errors import (
    BadSignature,
    CertificateExpired,
    CertificateRevoked,
    DecodeError,
    MeshllmError,
    OwnerRevoked,
    ReplayedEnvelope,
    StaleTimestamp,
    Untrusted,
    WrongRecipient,
)
from meshllm.identity.certs import certificate_id, issue_certificate
from meshllm.identity.envelope import seal
from meshllm.identity.ids import b32
from meshllm.identity.keys import NodeKey
from meshllm.identity.signing import encode_signed
from meshllm.identity.trust import TrustPolicy, TrustStore
from meshllm.owner.commands import COMMAND_KIND, OwnerCommand, command_digest, seal_command
from meshllm.owner.policy import CommandGate, CommandRefused, Uncertified, WrongOwner, refusal_code

NOW = 1_800_000_000.0
OWNER = SigningKey(b"o" * 32)
STRANGER = SigningKey(b"s" * 32)
NODE = NodeKey(SigningKey(b"n" * 32))
OTHER_NODE = NodeKey(SigningKey(b"m" * 32))
LOAD = OwnerCommand(op="load", model="default")


def certificate(owner: SigningKey = OWNER, node: NodeKey = NODE, lifetime: float = 86400.0) -> bytes:
    return encode_signed(issue_certificate(owner, node.node_id, NOW - 10, lifetime))


def trusting(*owners: SigningKey) -> TrustStore:
    store = TrustStore()
    for owner in owners:
        store.add_owner(b32(bytes(owner.verify_key)), now=NOW)
    return store


def command(owner: SigningKey = OWNER, node: NodeKey = NODE, now: float = NOW,
            order: OwnerCommand = LOAD) -> bytes:
    return seal_command(owner, node.node_id, order, now)


def test_a_fresh_command_from_the_certifying_trusted_owner_is_admitted() -> None:
    envelope = command()
    admitted = CommandGate(NODE).admit(envelope, NOW, certificate(), trusting(OWNER))
    assert admitted.command == LOAD and admitted.owner == b32(bytes(OWNER.verify_key))
    assert admitted.digest == command_digest(envelope)


@pytest.mark.parametrize("name,make,error,code", [
    ("expired", lambda: command(now=NOW - 61), StaleTimestamp, "expired"),
    ("from the future", lambda: command(now=NOW + 61), StaleTimestamp, "expired"),
    ("tampered", lambda: _flip(command(), -70), BadSignature, "tampered"),
    ("for another node", lambda: command(node=OTHER_NODE), WrongRecipient, "wrong_recipient"),
    ("wrong owner", lambda: command(owner=STRANGER), WrongOwner, "wrong_owner"),
    ("not encrypted", lambda: seal(NodeKey(OWNER), COMMAND_KIND, msgspec.msgpack.encode(LOAD), NOW),
     CommandRefused, "refused"),
    ("not a command", lambda: seal(NodeKey(OWNER), "down-notice", b"", NOW, recipient=NODE.node_id),
     MeshllmError, "malformed"),
    ("bad payload", lambda: seal(NodeKey(OWNER), COMMAND_KIND, b"\x93\x01\x02", NOW, recipient=NODE.node_id),
     DecodeError, "malformed"),
    ("garbage", lambda: b"\x00" * 40, DecodeError, "malformed"),
])
def test_refusals(name: str, make: object, error: type[Exception], code: str) -> None:
    with pytest.raises(error) as info:
        CommandGate(NODE).admit(make(), NOW, certificate(), trusting(OWNER, STRANGER))  # type: ignore[operator]
    assert refusal_code(info.value) == code  # type: ignore[arg-type]


def test_a_replayed_command_is_refused_and_a_forged_copy_does_not_use_up_the_real_one() -> None:
    gate, envelope = CommandGate(NODE), command()
    with pytest.raises(BadSignature):
        gate.admit(_flip(envelope, -70), NOW, certificate(), trusting(OWNER))
    gate.admit(envelope, NOW, certificate(), trusting(OWNER))
    with pytest.raises(ReplayedEnvelope) as info:
        gate.admit(envelope, NOW + 1, certificate(), trusting(OWNER))
    assert refusal_code(info.value) == "replayed"


def test_the_node_must_carry_a_valid_certificate_from_a_trusted_owner() -> None:
    gate = CommandGate(NODE)
    cases: list[tuple[bytes | None, TrustStore, type[Exception], str]] = [
        (None, trusting(OWNER), Uncertified, "uncertified"),
        (certificate(lifetime=5.0), trusting(OWNER), CertificateExpired, "certificate_expired"),
        (certificate(), trusting(), Untrusted, "untrusted_owner"),
        (certificate(node=OTHER_NODE), trusting(OWNER), MeshllmError, "certificate_not_for_this_node"),
    ]
    revoked_cert, revoked_owner = trusting(OWNER), trusting(OWNER)
    revoked_cert.revoke_certificate(certificate_id(certificate()))
    revoked_owner.revoke_owner(b32(bytes(OWNER.verify_key)))
    cases += [(certificate(), revoked_cert, CertificateRevoked, "revoked"),
              (certificate(), revoked_owner, OwnerRevoked, "revoked")]
    for cert, trust, error, code in cases:
        with pytest.raises(error) as info:
            gate.admit(command(), NOW, cert, trust)
        assert refusal_code(info.value) == code  # type: ignore[arg-type]


def test_trust_policy_off_and_disallowed_operations_refuse() -> None:
    off = trusting(OWNER)
    off.set_policy(TrustPolicy.OFF)
    with pytest.raises(CommandRefused, match="policy is off"):
        CommandGate(NODE).admit(command(), NOW, certificate(), off)
    with pytest.raises(CommandRefused, match="'load'"):
        CommandGate(NODE, allowed_ops=frozenset({"status"})).admit(command(), NOW, certificate(), trusting(OWNER))


def test_commands_whose_fields_do_not_fit_their_operation_cannot_be_sealed() -> None:
    for order in (OwnerCommand(op="load"), OwnerCommand(op="config"), OwnerCommand(op="status", model="m"),
                  OwnerCommand(op="drain", key="k")):
        with pytest.raises(DecodeError):
            command(order=order)


def _flip(data: bytes, at: int) -> bytes:
    buf = bytearray(data)
    buf[at] ^= 1
    return bytes(buf)
