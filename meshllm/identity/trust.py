"""Local trust policy: which peers this node accepts, and which it counts as its owner's.

Admission to a mesh (``mesh/admission.py``) says who may *join*; trust says what *this* node does
with them. The store is a JSON file in the home folder, edited by ``meshllm auth trust`` and
``meshllm auth revoke`` and read by the node at start. :meth:`TrustStore.evaluate` is pure: it takes
the peer's node id, its certificate bytes (if it presented one) and the time, and returns a
:class:`TrustDecision` or raises the typed reason for refusing.

Policies (checked after the node-id revocation list, which applies under every policy):

``off``
    Accept every peer. Certificates are not looked at; no peer is marked owned.
``prefer-owned`` (default)
    Accept every peer. A peer whose certificate is valid and signed by a trusted owner is marked
    *owned* (the router prefers owned peers). A revoked certificate or owner is refused; any other
    certificate problem (expired, forged, for another node, unknown owner) only means *not owned*,
    since an unowned peer is accepted anyway and refusing would add no protection.
``require-owned``
    Accept only owned peers: no certificate is :class:`Untrusted`, an unknown owner is
    :class:`Untrusted`, and every certificate problem raises its own error.
``allowlist``
    Accept only node ids on the allowlist, whatever their certificate says. Certificates are
    evaluated as under ``prefer-owned`` to mark allowlisted peers owned (and revocations refuse).
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from pathlib import Path

import msgspec

from meshllm.config import TRUST_FILE, write_private
from meshllm.errors import (
    CertificateRevoked,
    ConfigError,
    DecodeError,
    NodeRevoked,
    OwnerRevoked,
    Untrusted,
    VerificationError,
)
from meshllm.identity.certs import (
    NodeCertificate,
    certificate_id,
    check_subject,
    check_validity,
    decode_certificate,
    open_certificate,
)
from meshllm.identity.ids import b32, node_public_key, short

TRUST_VERSION = 1


class TrustPolicy(enum.StrEnum):
    """How a node treats peers; see the module docstring for the exact rules."""

    OFF = "off"
    PREFER_OWNED = "prefer-owned"
    REQUIRE_OWNED = "require-owned"
    ALLOWLIST = "allowlist"


@dataclass(frozen=True)
class TrustDecision:
    """The outcome of accepting a peer."""

    node_id: str
    """The peer evaluated."""
    policy: TrustPolicy
    """The policy it was evaluated under."""
    owned: bool = False
    """True when a valid certificate from a trusted owner vouches for the peer."""
    owner_pub: bytes | None = None
    """The trusted owner's public key, when owned."""
    owner_label: str | None = None
    """The local label of that owner, when owned."""
    certificate: NodeCertificate | None = None
    """The verified certificate, when owned."""
    note: str = ""
    """Why a presented certificate did not make the peer owned (empty otherwise)."""


class TrustedOwner(msgspec.Struct, frozen=True):
    """An owner key this node trusts, with a label for humans."""

    pub: str
    """Owner public key, base32 (the same text form as node ids)."""
    label: str = ""
    added: int = 0
    """Unix seconds when it was added."""


class TrustFile(msgspec.Struct, forbid_unknown_fields=True):
    """``trust.json`` on disk."""

    v: int = TRUST_VERSION
    policy: TrustPolicy = TrustPolicy.PREFER_OWNED
    owners: list[TrustedOwner] = []
    revoked_owners: list[str] = []
    revoked_certs: list[str] = []
    revoked_nodes: list[str] = []
    allowlist: list[str] = []


@dataclass
class TrustStore:
    """The trust store in memory; :meth:`save` writes it back atomically."""

    data: TrustFile = field(default_factory=TrustFile)
    path: Path | None = None

    @classmethod
    def load(cls, home: Path) -> TrustStore:
        """Read ``trust.json`` from ``home``; a missing file is the default (prefer-owned, empty)."""
        path = home / TRUST_FILE
        if not path.exists():
            return cls(TrustFile(), path)
        try:
            data = path.read_bytes()
        except OSError as exc:
            raise ConfigError(f"cannot read trust store {path}: {exc.strerror}") from exc
        return cls(decode_trust_file(data, str(path)), path)

    def save(self) -> None:
        """Write the store back to the file it came from (mode 0600, atomic)."""
        if self.path is None:
            raise ConfigError("this trust store has no file to save to")
        write_private(self.path, msgspec.json.format(msgspec.json.encode(self.data)) + b"\n")

    # -- editing ------------------------------------------------------------------------------

    def set_policy(self, policy: TrustPolicy) -> None:
        self.data.policy = policy

    def add_owner(self, owner_pub: str, label: str = "", now: float | None = None) -> None:
        """Trust ``owner_pub`` (base32); re-adding updates the label."""
        pub = _key_text(owner_pub, "owner key")
        if pub in self.data.revoked_owners:
            raise ConfigError(f"owner {short(pub)} is revoked", hint="a revoked owner cannot be trusted again")
        added = int(time.time() if now is None else now)
        self.data.owners = [o for o in self.data.owners if o.pub != pub] + [TrustedOwner(pub, label, added)]

    def remove_owner(self, owner_pub: str) -> None:
        """Stop trusting ``owner_pub``; :class:`ConfigError` if it was not trusted."""
        pub = _key_text(owner_pub, "owner key")
        if self.owner(pub) is None:
            raise ConfigError(f"owner {short(pub)} is not in the trust store", hint="see `meshllm auth trust list`")
        self.data.owners = [o for o in self.data.owners if o.pub != pub]

    def revoke_owner(self, owner_pub: str) -> None:
        """Refuse every certificate signed by ``owner_pub`` (and stop trusting it)."""
        pub = _key_text(owner_pub, "owner key")
        self.data.owners = [o for o in self.data.owners if o.pub != pub]
        _add_unique(self.data.revoked_owners, pub)

    def revoke_certificate(self, cert_id: str) -> None:
        """Refuse the certificate with this id (hex sha256, see :func:`certificate_id`)."""
        text = cert_id.strip().lower()
        if len(text) != 64 or not set(text) <= set("0123456789abcdef"):
            raise ConfigError(f"{cert_id[:20]!r} is not a certificate id (64 hex digits)")
        _add_unique(self.data.revoked_certs, text)

    def revoke_node(self, node_id: str) -> None:
        """Refuse this node id under every policy."""
        _add_unique(self.data.revoked_nodes, _key_text(node_id, "node id"))

    def allow_node(self, node_id: str) -> None:
        _add_unique(self.data.allowlist, _key_text(node_id, "node id"))

    def disallow_node(self, node_id: str) -> None:
        text = _key_text(node_id, "node id")
        if text not in self.data.allowlist:
            raise ConfigError(f"node {short(text)} is not on the allowlist")
        self.data.allowlist.remove(text)

    def owner(self, owner_pub: str) -> TrustedOwner | None:
        """The trusted-owner entry for ``owner_pub`` (base32), if any."""
        return next((o for o in self.data.owners if o.pub == owner_pub), None)

    # -- deciding -----------------------------------------------------------------------------

    def check_node_id(self, node_id: str) -> None:
        """The checks that need no certificate: a revoked node id, or one missing from the allowlist.

        The transport runs this at admission, before the peer's record (and certificate) is known,
        so a node refused here never gets a stream served.
        """
        if node_id in self.data.revoked_nodes:
            raise NodeRevoked(f"node {short(node_id)} is revoked in this node's trust store")
        if self.data.policy is TrustPolicy.ALLOWLIST and node_id not in self.data.allowlist:
            raise Untrusted(f"node {short(node_id)} is not on the allowlist",
                            hint=f"run `meshllm auth trust allow {node_id}` to accept it")

    def evaluate(self, node_id: str, certificate: bytes | None, now: float) -> TrustDecision:
        """Accept or refuse peer ``node_id`` presenting ``certificate`` (or none) at time ``now``."""
        policy = self.data.policy
        self.check_node_id(node_id)
        if policy is TrustPolicy.OFF:
            return TrustDecision(node_id, policy)
        strict = policy is TrustPolicy.REQUIRE_OWNED
        if certificate is None:
            if strict:
                raise Untrusted(f"node {short(node_id)} presented no owner certificate (policy require-owned)")
            return TrustDecision(node_id, policy)
        try:
            return self.owned_by(node_id, certificate, now, policy)
        except (CertificateRevoked, OwnerRevoked):
            raise
        except (DecodeError, VerificationError) as exc:
            if strict:
                raise
            return TrustDecision(node_id, policy, note=str(exc))

    def owned_by(self, node_id: str, certificate: bytes, now: float,
                 policy: TrustPolicy | None = None) -> TrustDecision:
        """The decision for a node whose certificate must make it owned, or the reason it does not.

        Every certificate rule, whatever the policy: owner commands (``owner/policy.py``) ask this of
        the node's own certificate.
        """
        policy = self.data.policy if policy is None else policy
        signed = decode_certificate(certificate)
        cert = open_certificate(signed)
        # Revocations come before the subject and time checks: "revoked" is the more useful
        # answer for a certificate that is also expired, and it must hold for any presenter.
        if certificate_id(signed) in self.data.revoked_certs:
            raise CertificateRevoked(f"the certificate presented by node {short(node_id)} is revoked")
        if b32(cert.owner_pub) in self.data.revoked_owners:
            raise OwnerRevoked(f"node {short(node_id)} is certified by revoked owner {short(b32(cert.owner_pub))}")
        check_subject(cert, node_id)
        check_validity(cert, now)
        owner = self.owner(b32(cert.owner_pub))
        if owner is None:
            raise Untrusted(f"node {short(node_id)} is certified by owner {short(b32(cert.owner_pub))}, "
                            "which this node does not trust",
                            hint=f"run `meshllm auth trust add {b32(cert.owner_pub)}` to trust it")
        return TrustDecision(node_id, policy, owned=True, owner_pub=cert.owner_pub, owner_label=owner.label,
                             certificate=cert)


def decode_trust_file(data: bytes, where: str = "trust.json") -> TrustFile:
    """Parse and validate trust-store bytes; :class:`ConfigError` (naming ``where``) if unusable."""
    try:
        trust = msgspec.json.decode(data, type=TrustFile)
        if trust.v != TRUST_VERSION:
            raise ValueError(f"version {trust.v} is not supported")
        for key in [o.pub for o in trust.owners] + trust.revoked_owners + trust.revoked_nodes + trust.allowlist:
            node_public_key(key)
        for cert_id in trust.revoked_certs:
            if len(cert_id) != 64 or not set(cert_id) <= set("0123456789abcdef"):
                raise ValueError(f"{cert_id[:20]!r} is not a certificate id")
    except (msgspec.DecodeError, msgspec.ValidationError, ValueError, RecursionError, DecodeError) as exc:
        raise ConfigError(f"cannot read trust store {where}: {exc}", hint="fix or delete the file") from exc
    return trust


def _key_text(text: str, what: str) -> str:
    """Normalise a base32 key (owner key or node id), raising :class:`ConfigError` if it is not one."""
    norm = text.strip().lower()
    try:
        node_public_key(norm)
    except DecodeError:
        raise ConfigError(f"{text[:20]!r} is not a valid {what} (52 base32 characters)") from None
    return norm


def _add_unique(items: list[str], item: str) -> None:
    if item not in items:
        items.append(item)
