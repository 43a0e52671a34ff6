"""The TLS identity module, checked directly against the installed aioquic (private hooks)."""

from __future__ import annotations

import datetime

import pytest
from aioquic import tls as aioquic_tls
from cryptography import x509
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from nacl.signing import SigningKey
from net_helpers import quic_pair

from meshllm.errors import VerificationError
from meshllm.identity.ids import node_id
from meshllm.net import tls
from meshllm.net.errors import AioquicIncompatible


def test_certificate_carries_the_node_key() -> None:
    key = SigningKey.generate()
    cert = tls.make_certificate(key)
    assert tls.certificate_node_id(cert) == node_id(bytes(key.verify_key))
    assert cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value == node_id(bytes(key.verify_key))


def test_non_ed25519_certificate_is_refused() -> None:
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "x")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
        .serial_number(1).not_valid_before(now).not_valid_after(now + datetime.timedelta(days=1))
        .sign(key, hashes.SHA256())
    )
    with pytest.raises(VerificationError, match="not an Ed25519"):
        tls.certificate_node_id(cert)


def test_private_hooks_exist_in_installed_aioquic() -> None:
    context = aioquic_tls.Context(is_client=False)
    tls.request_client_certificate(context)
    assert context._request_client_certificate is True
    assert tls.peer_certificate(context) is None


def test_hooks_fail_loudly_when_aioquic_moves_them() -> None:
    class Moved:
        pass

    with pytest.raises(AioquicIncompatible):
        tls.request_client_certificate(Moved())  # type: ignore[arg-type]
    with pytest.raises(AioquicIncompatible):
        tls.peer_certificate(Moved())  # type: ignore[arg-type]


def test_handshake_is_mutual_and_proves_both_node_ids() -> None:
    ck, sk = SigningKey.generate(), SigningKey.generate()
    client, server = quic_pair(ck, sk)
    assert tls.peer_node_id(client.tls) == node_id(bytes(sk.verify_key))
    assert tls.peer_node_id(server.tls) == node_id(bytes(ck.verify_key))


def test_missing_peer_certificate_is_a_verification_error() -> None:
    with pytest.raises(VerificationError, match="no TLS certificate"):
        tls.peer_node_id(aioquic_tls.Context(is_client=False))
