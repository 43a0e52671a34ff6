"""Property tests for the shared signed container: bad bytes only ever give typed errors."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from identity_strategies import random_or_mutated
from nacl.signing import SigningKey

from meshllm.errors import DecodeError, VerificationError, WrongDomain
from meshllm.identity.certs import NodeCertificate
from meshllm.identity.signing import decode_signed, encode_signed, sign, verify

_KEY = SigningKey.generate()
_VALID = [encode_signed(sign(_KEY, "node-cert", NodeCertificate("a" * 52, bytes(_KEY.verify_key), 1, 2, "x")))]


@settings(max_examples=2000, deadline=None)
@given(random_or_mutated(_VALID))
def test_decode_signed_and_verify_raise_only_typed_errors(data: bytes) -> None:
    try:
        signed = decode_signed(data)
        verify(signed, "node-cert", NodeCertificate)
    except (DecodeError, VerificationError):
        return
    assert data == _VALID[0] or decode_signed(data) == decode_signed(_VALID[0])


def test_wrong_domain_is_its_own_error() -> None:
    signed = decode_signed(_VALID[0])
    with pytest.raises(WrongDomain):
        verify(signed, "invite", NodeCertificate)
