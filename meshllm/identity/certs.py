"""Node certificates: an owner's signed statement "this node id is mine, until this time".

A certificate is a :class:`~meshllm.identity.signing.Signed` with domain ``node-cert`` whose body
is a :class:`NodeCertificate`. It is short-lived (7 days by default) so a lost certificate stops
working on its own; revocation (by certificate id, in the trust store) covers the time until then.
"""

from __future__ import annotations

import base64
import binascii
import hashlib

import msgspec
from nacl.signing import SigningKey

from meshllm.errors import CertificateExpired, DecodeError, WrongSigner, WrongSubject
from meshllm.identity.ids import node_public_key
from meshllm.identity.signing import CLOCK_SKEW_S, Signed, decode_signed, encode_signed, sign, verify

CERT_DOMAIN = "node-cert"
DEFAULT_CERT_LIFETIME_S = 7 * 86400
MAX_CERT_LIFETIME_S = 366 * 86400
# Tolerance for the issuer's clock running ahead of the verifier's, so a fresh certificate is
# not "not yet valid" on a peer whose clock is a little behind.


class NodeCertificate(msgspec.Struct, array_like=True, frozen=True):
    """What an owner signs about one node."""

    node_id: str
    """The node this certificate is about."""
    owner_pub: bytes
    """The owner's Ed25519 public key; must be the signer."""
    issued: int
    """Unix seconds when it was signed; not valid before (minus :data:`CLOCK_SKEW_S`)."""
    expires: int
    """Unix seconds from which it is no longer valid."""
    label: str
    """Free text chosen by the owner (host name, role); shown to operators, never trusted."""


def issue_certificate(owner_key: SigningKey, node_id: str, now: float,
                      lifetime: float = DEFAULT_CERT_LIFETIME_S, label: str = "") -> Signed:
    """Sign a certificate for ``node_id`` valid from ``now`` for ``lifetime`` seconds."""
    node_public_key(node_id)  # refuse to sign something that is not a node id
    if not 0 < lifetime <= MAX_CERT_LIFETIME_S:
        raise ValueError(f"certificate lifetime must be between 1 s and {MAX_CERT_LIFETIME_S // 86400} days")
    issued = int(now)
    cert = NodeCertificate(node_id, bytes(owner_key.verify_key), issued, issued + int(lifetime), label)
    return sign(owner_key, CERT_DOMAIN, cert)


def verify_certificate(data_or_signed: bytes | Signed, node_id: str | None, now: float) -> NodeCertificate:
    """Check a certificate completely and return its contents.

    Raises :class:`DecodeError` (malformed), :class:`WrongDomain` (not a certificate),
    :class:`BadSignature` (forged), :class:`WrongSigner` (signer is not the owner it names, or it
    names another node than ``node_id``), :class:`CertificateExpired` (outside its lifetime).
    ``node_id=None`` skips the subject check (for displaying a token before installing it).
    """
    signed = decode_certificate(data_or_signed) if isinstance(data_or_signed, bytes) else data_or_signed
    cert = open_certificate(signed)
    if node_id is not None:
        check_subject(cert, node_id)
    check_validity(cert, now)
    return cert


def open_certificate(signed: Signed) -> NodeCertificate:
    """Check domain and signature, and that the signer is the owner named inside; no time checks."""
    cert = verify(signed, CERT_DOMAIN, NodeCertificate)
    if cert.owner_pub != signed.signer:
        raise WrongSigner("node certificate is signed by another key than the owner it names")
    return cert


def check_subject(cert: NodeCertificate, node_id: str) -> None:
    """Raise :class:`WrongSubject` unless the certificate is about ``node_id``.

    A certificate is public, so any node can present another node's; only the subject binds it.
    """
    if cert.node_id != node_id:
        raise WrongSubject(f"node certificate is for node {cert.node_id[:8]}, not {node_id[:8]}")


def check_validity(cert: NodeCertificate, now: float) -> None:
    """Raise :class:`CertificateExpired` unless ``now`` lies inside the certificate's lifetime."""
    if now < cert.issued - CLOCK_SKEW_S:
        raise CertificateExpired(f"node certificate is not valid before {cert.issued} (now {int(now)})",
                                 hint="check the clocks of the owner's and this machine")
    if now >= cert.expires:
        raise CertificateExpired(f"node certificate expired at {cert.expires} (now {int(now)})",
                                 hint="renew it with `meshllm auth sign-node`")


def decode_certificate(data: bytes) -> Signed:
    """Parse certificate bytes into a :class:`Signed` (structure only)."""
    return decode_signed(data, "node certificate")


def certificate_id(data_or_signed: bytes | Signed) -> str:
    """The id revocations name: hex sha256 of the certificate's canonical encoding.

    Re-encoding first makes the id independent of how a sender chose to pack the container; the
    body and signature themselves cannot vary without the owner's key.
    """
    signed = decode_certificate(data_or_signed) if isinstance(data_or_signed, bytes) else data_or_signed
    return hashlib.sha256(encode_signed(signed)).hexdigest()


def certificate_token(signed: Signed) -> str:
    """Text form of a certificate for copying between machines (base64url, unpadded)."""
    return base64.urlsafe_b64encode(encode_signed(signed)).decode("ascii").rstrip("=")


def parse_certificate_token(token: str) -> Signed:
    """Inverse of :func:`certificate_token`; :class:`DecodeError` on bad text."""
    text = token.strip()
    try:
        data = base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))
    except (binascii.Error, ValueError) as exc:
        raise DecodeError("certificate token is not base64url text") from exc
    return decode_certificate(data)
