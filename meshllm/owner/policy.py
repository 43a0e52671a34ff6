"""Whether a node executes an owner command (sans-IO: bytes, the node's certificate, its trust store, ``now``).

A command is executed only when all of these hold, checked in this order, each refusal with its own
error and result code:

1. the envelope opens (``identity/envelope.py``): well-formed, of kind ``owner-command``, timestamp
   within 60 s of this node's clock (``expired``), not seen before (``replayed``), signature good
   (``tampered``), addressed and encrypted to this node;
2. the node carries an owner certificate (``uncertified``) and the command is signed by the owner
   that certificate names (``wrong_owner``): a key that certified other nodes, or none, has no say here;
3. the certificate passes every rule of the trust store (``TrustStore.owned_by``): not revoked, nor
   its owner, for this node, inside its lifetime, and its owner is one this node trusts;
4. the trust policy is not ``off`` (under which the node recognises no owner at all), and the
   operation is one the node allows.

The replay cache is the envelope receiver's: bounded, time-windowed, and written only for envelopes
whose signature verified, so a forged command cannot use up a real one's nonce.
"""

from __future__ import annotations

from dataclasses import dataclass

from meshllm.errors import (
    BadSignature,
    CertificateExpired,
    DecodeError,
    MeshllmError,
    NonceReused,
    ReplayedEnvelope,
    Revoked,
    StaleTimestamp,
    Untrusted,
    VerificationError,
    WrongKind,
    WrongRecipient,
    WrongSigner,
    WrongSubject,
)
from meshllm.identity.certs import decode_certificate, open_certificate
from meshllm.identity.envelope import EnvelopeReceiver
from meshllm.identity.ids import b32, short
from meshllm.identity.keys import NodeKey
from meshllm.identity.trust import TrustPolicy, TrustStore
from meshllm.owner.commands import COMMAND_KIND, OPS, OwnerCommand, command_digest, decode_command

REPLAY_CACHE_ENTRIES = 10_000
"""Commands remembered inside the window; far above what an owner sends in a minute."""


class Uncertified(VerificationError):
    """This node carries no owner certificate, so no owner may command it."""

    hint = "certify it: `meshllm auth sign-node --node-id ID` on the owner's machine, then `auth install-cert`"


class WrongOwner(WrongSigner):
    """The command is signed by another key than the owner that certified this node."""


class CommandRefused(VerificationError):
    """The node's settings refuse the command (trust policy ``off``, or an operation it does not allow)."""


REFUSAL_CODES: tuple[tuple[type[MeshllmError], str], ...] = (
    (StaleTimestamp, "expired"),
    (ReplayedEnvelope, "replayed"),
    (NonceReused, "replayed"),
    (BadSignature, "tampered"),
    (WrongRecipient, "wrong_recipient"),
    (Uncertified, "uncertified"),
    (WrongOwner, "wrong_owner"),
    (CertificateExpired, "certificate_expired"),
    (Revoked, "revoked"),
    (Untrusted, "untrusted_owner"),
    (WrongSubject, "certificate_not_for_this_node"),
    (CommandRefused, "refused"),
    (WrongKind, "malformed"),
    (DecodeError, "malformed"),
)


def refusal_code(exc: MeshllmError) -> str:
    """The result code for a refusal (the most specific class wins)."""
    for cls, code in REFUSAL_CODES:
        if isinstance(exc, cls):
            return code
    return "refused"


@dataclass(frozen=True)
class Admitted:
    """A command that passed every check."""

    command: OwnerCommand
    owner: str
    """The owner's key, in node-id form (what the result is encrypted to)."""
    digest: bytes
    """:func:`~meshllm.owner.commands.command_digest` of the envelope."""


class CommandGate:
    """Opens command envelopes for one node and decides whether it may execute them."""

    def __init__(self, key: NodeKey, allowed_ops: frozenset[str] = frozenset(OPS)) -> None:
        self.key = key
        self.allowed_ops = allowed_ops
        self.receiver = EnvelopeReceiver(key, max_entries=REPLAY_CACHE_ENTRIES)

    def admit(self, envelope: bytes, now: float, certificate: bytes | None, trust: TrustStore) -> Admitted:
        """The command in ``envelope`` if this node may execute it now; otherwise the typed reason."""
        opened = self.receiver.open(envelope, COMMAND_KIND, now)
        if not opened.encrypted:
            raise CommandRefused("owner commands must be encrypted to the node they address")
        command = decode_command(opened.payload)
        self.check_owner(opened.sender, certificate, trust, now)
        if command.op not in self.allowed_ops:
            raise CommandRefused(f"this node does not take {command.op!r} commands")
        return Admitted(command, opened.sender, command_digest(envelope))

    def check_owner(self, sender: str, certificate: bytes | None, trust: TrustStore, now: float) -> None:
        """Raise unless ``sender`` is the trusted owner whose valid certificate this node carries."""
        if trust.data.policy is TrustPolicy.OFF:
            raise CommandRefused("this node's trust policy is off: it recognises no owner",
                                 hint="`meshllm auth trust policy prefer-owned` on that node")
        if certificate is None:
            raise Uncertified(f"node {short(self.key.node_id)} has no owner certificate")
        cert = open_certificate(decode_certificate(certificate))
        if b32(cert.owner_pub) != sender:
            raise WrongOwner(f"the command is signed by {short(sender)}, but node {short(self.key.node_id)} "
                             f"is certified by owner {short(b32(cert.owner_pub))}")
        trust.owned_by(self.key.node_id, certificate, now)
