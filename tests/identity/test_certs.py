"""Node certificates: each verification rule raises its own error; valid ones pass."""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import given, settings
from identity_strategies import random_or_mutated
from nacl.signing import SigningKey

from meshllm.errors import (
    BadSignature,
    CertificateExpired,
    DecodeError,
    VerificationError,
    WrongDomain,
    WrongSigner,
    WrongSubject,
)
from meshllm.identity.certs import (
    CLOCK_SKEW_S,
    DEFAULT_CERT_LIFETIME_S,
    NodeCertificate,
    certificate_id,
    certificate_token,
    issue_certificate,
    parse_certificate_token,
    verify_certificate,
)
from meshllm.identity.ids import b32
from meshllm.identity.keys import NodeKey
from meshllm.identity.signing import Signed, encode_signed, sign

NOW = 1_800_000_000.0
OWNER = SigningKey.generate()
NODE = NodeKey.ephemeral()


def _cert(**kw: object) -> Signed:
    args: dict = {"owner_key": OWNER, "node_id": NODE.node_id, "now": NOW, "label": "laptop"} | kw
    return issue_certificate(**args)


def test_valid_certificate_is_accepted_from_bytes_and_struct() -> None:
    signed = _cert()
    for form in (signed, encode_signed(signed)):
        cert = verify_certificate(form, NODE.node_id, NOW + 1)
        assert (cert.node_id, cert.owner_pub, cert.label) == (NODE.node_id, bytes(OWNER.verify_key), "laptop")
        assert cert.expires - cert.issued == DEFAULT_CERT_LIFETIME_S


def test_forged_signature_is_bad_signature() -> None:
    signed = _cert()
    forged = msgspec.structs.replace(signed, sig=bytes([signed.sig[0] ^ 1]) + signed.sig[1:])
    with pytest.raises(BadSignature):
        verify_certificate(forged, NODE.node_id, NOW)


def test_body_signed_by_someone_else_is_bad_signature() -> None:
    mallory = SigningKey.generate()
    body = msgspec.msgpack.encode(NodeCertificate(NODE.node_id, bytes(OWNER.verify_key), int(NOW), int(NOW) + 60, ""))
    sig = mallory.sign(b"meshllm/node-cert/v1\0" + body).signature
    forged = Signed("node-cert", bytes(OWNER.verify_key), body, sig)
    with pytest.raises(BadSignature):
        verify_certificate(forged, NODE.node_id, NOW)


def test_wrong_domain_is_refused() -> None:
    cert = NodeCertificate(NODE.node_id, bytes(OWNER.verify_key), int(NOW), int(NOW) + 60, "")
    with pytest.raises(WrongDomain):
        verify_certificate(sign(OWNER, "invite", cert), NODE.node_id, NOW)


def test_signer_other_than_named_owner_is_wrong_signer() -> None:
    mallory = SigningKey.generate()
    cert = NodeCertificate(NODE.node_id, bytes(OWNER.verify_key), int(NOW), int(NOW) + 60, "")
    with pytest.raises(WrongSigner, match="owner it names"):
        verify_certificate(sign(mallory, "node-cert", cert), NODE.node_id, NOW)


def test_certificate_for_another_node_is_wrong_signer() -> None:
    with pytest.raises(WrongSubject, match="is for node"):
        verify_certificate(_cert(), NodeKey.ephemeral().node_id, NOW)


def test_expired_certificate() -> None:
    signed = _cert(lifetime=3600)
    verify_certificate(signed, NODE.node_id, NOW + 3599)
    with pytest.raises(CertificateExpired, match="expired"):
        verify_certificate(signed, NODE.node_id, NOW + 3600)


def test_not_yet_valid_certificate() -> None:
    signed = _cert()
    verify_certificate(signed, NODE.node_id, NOW - CLOCK_SKEW_S)  # small clock skew tolerated
    with pytest.raises(CertificateExpired, match="not valid before"):
        verify_certificate(signed, NODE.node_id, NOW - CLOCK_SKEW_S - 1)


def test_issue_refuses_bad_node_id_and_lifetime() -> None:
    with pytest.raises(DecodeError):
        issue_certificate(OWNER, "not-a-node-id", NOW)
    with pytest.raises(ValueError, match="lifetime"):
        issue_certificate(OWNER, NODE.node_id, NOW, lifetime=0)


def test_certificate_id_and_token() -> None:
    signed = _cert()
    cid = certificate_id(signed)
    assert len(cid) == 64 and int(cid, 16) >= 0
    assert certificate_id(encode_signed(signed)) == cid
    assert certificate_id(_cert(label="other")) != cid
    assert parse_certificate_token(certificate_token(signed)) == signed
    assert b32(signed.signer) not in certificate_token(signed)  # token is opaque base64url
    with pytest.raises(DecodeError):
        parse_certificate_token("!!not base64!!")


_VALID = [encode_signed(_cert()), encode_signed(_cert(lifetime=60, label=""))]


@settings(max_examples=2000, deadline=None)
@given(random_or_mutated(_VALID))
def test_decoder_raises_only_typed_errors(data: bytes) -> None:
    try:
        verify_certificate(data, NODE.node_id, NOW)
        certificate_id(data)
    except (DecodeError, VerificationError):
        pass
