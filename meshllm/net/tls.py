"""Node identity in TLS: self-signed Ed25519 certificates and aioquic's mutual-TLS hooks.

A node's TLS certificate is self-signed by its node key, so the certificate's public key *is*
the node id and no CA is involved. Both ends present a certificate; each end checks the peer's
key itself (CA verification is switched off). aioquic has no public switch to ask a client for a
certificate, nor a public accessor for the peer's certificate: the two private attributes used
for that are touched here and only here, and ``tests/net/test_tls.py`` checks them directly so an
aioquic upgrade that moves them fails loudly instead of silently skipping client authentication.
"""

from __future__ import annotations

import datetime

from aioquic import tls as aioquic_tls
from cryptography import x509
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat
from cryptography.x509.oid import NameOID
from nacl.signing import SigningKey

from meshllm.errors import VerificationError
from meshllm.identity.ids import node_id
from meshllm.net.errors import AioquicIncompatible

_REQUEST_CLIENT_CERT = "_request_client_certificate"
_PEER_CERT = "_peer_certificate"


def private_key(signing_key: SigningKey) -> Ed25519PrivateKey:
    """The node key as a ``cryptography`` key (same 32-byte seed), for TLS signing."""
    return Ed25519PrivateKey.from_private_bytes(signing_key.encode())


def make_certificate(signing_key: SigningKey) -> x509.Certificate:
    """A self-signed certificate on the node key, named after the node id.

    Validity is wide (a day back, ten years ahead) because nobody checks it: the identity is the
    key, and clock skew between peers must not break connections.
    """
    key = private_key(signing_key)
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, node_id(bytes(signing_key.verify_key)))])
    now = datetime.datetime.now(datetime.UTC)
    return (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(days=1))
        .not_valid_after(now + datetime.timedelta(days=3650))
        .sign(key, algorithm=None)
    )


def certificate_node_id(certificate: x509.Certificate) -> str:
    """The node id a certificate proves (its Ed25519 public key); refuses any other key type."""
    key = certificate.public_key()
    if not isinstance(key, Ed25519PublicKey):
        raise VerificationError(f"peer certificate carries a {type(key).__name__}, not an Ed25519 node key")
    return node_id(key.public_bytes(Encoding.Raw, PublicFormat.Raw))


def request_client_certificate(context: aioquic_tls.Context) -> None:
    """Make a server-side TLS context ask the client for its certificate (mutual TLS)."""
    if not hasattr(context, _REQUEST_CLIENT_CERT):
        raise AioquicIncompatible(f"aioquic's tls.Context has no {_REQUEST_CLIENT_CERT} flag")
    setattr(context, _REQUEST_CLIENT_CERT, True)


def peer_certificate(context: aioquic_tls.Context) -> x509.Certificate | None:
    """The certificate the peer presented in the handshake, or None if it sent none."""
    if not hasattr(context, _PEER_CERT):
        raise AioquicIncompatible(f"aioquic's tls.Context has no {_PEER_CERT} attribute")
    cert = getattr(context, _PEER_CERT)
    if cert is not None and not isinstance(cert, x509.Certificate):
        raise AioquicIncompatible(f"aioquic's {_PEER_CERT} is a {type(cert).__name__}, not a certificate")
    return cert


def peer_node_id(context: aioquic_tls.Context) -> str:
    """The node id proven by the peer's certificate (the handshake proved key possession)."""
    cert = peer_certificate(context)
    if cert is None:
        raise VerificationError("peer presented no TLS certificate; every meshllm node must")
    return certificate_node_id(cert)
