"""Node identity in TLS 1.3 over TCP (the ``ssl`` module): mutual authentication on node keys.

The QUIC transport pins a peer's certificate to its node id with CA checks switched off
(``net/tls.py``). The standard ``ssl`` module cannot switch them off for a *client's*
certificate: a server that asks for one (``CERT_REQUIRED``) has OpenSSL verify its chain and
offers no callback to accept it anyway. So every node's TCP certificate is issued by one
**public** CA whose key is derived from a fixed string: anyone can issue a certificate under it,
which makes the chain check vacuous by design, and the real check is the same as on QUIC: after
the handshake (whose CertificateVerify proved possession of the leaf's private key) the leaf's
Ed25519 key must be the node id we expect (dialer) or a node we know (listener).

``ssl`` loads keys only from files: :func:`contexts` writes the node key to a 0600 file in a
0700 temporary folder and removes both as soon as OpenSSL has read them.
"""

from __future__ import annotations

import datetime
import hashlib
import ssl
import tempfile
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.serialization import Encoding, NoEncryption, PrivateFormat
from cryptography.x509.oid import NameOID
from nacl.signing import SigningKey

from meshllm.errors import VerificationError
from meshllm.identity.ids import node_id
from meshllm.net.errors import PeerMismatch
from meshllm.net.tls import certificate_node_id, private_key

_CA_SEED = hashlib.sha256(b"meshllm/public-tcp-ca/v1").digest()
"""The public CA's key seed: public on purpose (see the module docstring)."""
_EPOCH = datetime.datetime(2025, 1, 1, tzinfo=datetime.UTC)


def _ca() -> tuple[Ed25519PrivateKey, x509.Certificate]:
    key = Ed25519PrivateKey.from_private_bytes(_CA_SEED)
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "meshllm public tcp ca")])
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(1)
        .not_valid_before(_EPOCH)
        .not_valid_after(_EPOCH + datetime.timedelta(days=36500))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .sign(key, algorithm=None)
    )
    return key, cert


def node_certificate(signing_key: SigningKey) -> tuple[x509.Certificate, x509.Certificate]:
    """The node's TCP certificate (its node key, issued by the public CA) and the CA certificate."""
    ca_key, ca_cert = _ca()
    key = private_key(signing_key)
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME,
                                                    node_id(bytes(signing_key.verify_key)))]))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(days=1))
        .not_valid_after(now + datetime.timedelta(days=3650))
        .sign(ca_key, algorithm=None)
    )
    return cert, ca_cert


def contexts(signing_key: SigningKey) -> tuple[ssl.SSLContext, ssl.SSLContext]:
    """``(server, client)`` TLS 1.3 contexts presenting the node key and requiring the peer's."""
    cert, ca_cert = node_certificate(signing_key)
    out = []
    with tempfile.TemporaryDirectory(prefix="meshllm-tls-") as tmp:
        cert_file, key_file = Path(tmp, "cert.pem"), Path(tmp, "key.pem")
        cert_file.write_bytes(cert.public_bytes(Encoding.PEM))
        key_file.touch(mode=0o600)
        key_file.write_bytes(private_key(signing_key).private_bytes(Encoding.PEM, PrivateFormat.PKCS8,
                                                                    NoEncryption()))
        for purpose in (ssl.PROTOCOL_TLS_SERVER, ssl.PROTOCOL_TLS_CLIENT):
            ctx = ssl.SSLContext(purpose)
            ctx.minimum_version = ssl.TLSVersion.TLSv1_3
            ctx.check_hostname = False
            ctx.verify_mode = ssl.CERT_REQUIRED
            ctx.load_cert_chain(cert_file, key_file)
            ctx.load_verify_locations(cadata=ca_cert.public_bytes(Encoding.PEM).decode())
            out.append(ctx)
    return out[0], out[1]


def peer_node_id(ssl_object: ssl.SSLObject | ssl.SSLSocket) -> str:
    """The node id the peer's certificate proves (the handshake proved it holds the key)."""
    der = ssl_object.getpeercert(binary_form=True)
    if not der:
        raise VerificationError("peer presented no TLS certificate; every meshllm node must")
    return certificate_node_id(x509.load_der_x509_certificate(der))


def check_peer(ssl_object: ssl.SSLObject | ssl.SSLSocket, expected: str) -> None:
    """Refuse (``PeerMismatch``) a peer whose certificate carries another key than ``expected``."""
    got = peer_node_id(ssl_object)
    if got != expected:
        raise PeerMismatch(f"the TLS peer is node {got}, not {expected}")
