"""Domain-separated Ed25519 signatures over msgspec structs.

Every signed object in meshllm travels as a :class:`Signed` container: the purpose (domain) in
the clear, the signer's public key, the msgpack body and the signature over
``b"meshllm/<domain>/v1\\0" + body``. Carrying the domain in the clear lets a receiver say
*wrong domain* (an object signed for another purpose) apart from *bad signature* (forged or
tampered); signing over the tag means a signature for one purpose can never be replayed as another.
"""

from __future__ import annotations

from typing import TypeVar

import msgspec
from nacl.exceptions import BadSignatureError
from nacl.signing import SigningKey, VerifyKey

from meshllm.errors import BadSignature, DecodeError, WrongDomain, WrongSigner

T = TypeVar("T", bound=msgspec.Struct)

SIGNATURE_SIZE = 64
CLOCK_SKEW_S = 60.0
"""How far in the future a signed object's issue time may lie before it is refused (clocks differ)."""


class Signed(msgspec.Struct, array_like=True, frozen=True, forbid_unknown_fields=True):
    """A signed body: what every signed object is on the wire."""

    domain: str
    """Purpose of the signature, e.g. ``"invite"``; the tag signed is ``meshllm/<domain>/v1\\0``."""
    signer: bytes
    """Ed25519 public key (32 bytes) of the signer."""
    body: bytes
    """msgpack encoding of the signed struct."""
    sig: bytes
    """Ed25519 signature (64 bytes) over the domain tag followed by ``body``."""


def domain_tag(domain: str) -> bytes:
    """The bytes prefixed to everything signed for ``domain``."""
    return f"meshllm/{domain}/v1".encode() + b"\0"


def sign_bytes(key: SigningKey, domain: str, body: bytes) -> bytes:
    """Raw 64-byte signature over ``domain_tag(domain) + body``."""
    return key.sign(domain_tag(domain) + body).signature


def verify_bytes(public_key: bytes, domain: str, body: bytes, sig: bytes) -> None:
    """Raise :class:`BadSignature` unless ``sig`` signs ``body`` for ``domain`` under ``public_key``."""
    if len(public_key) != 32 or len(sig) != SIGNATURE_SIZE:
        raise BadSignature(f"malformed {domain} signature or key")
    try:
        VerifyKey(public_key).verify(domain_tag(domain) + body, sig)
    except (BadSignatureError, ValueError) as exc:
        raise BadSignature(f"{domain} signature does not verify") from exc


def sign(key: SigningKey, domain: str, obj: msgspec.Struct) -> Signed:
    """Sign ``obj`` for ``domain``."""
    body = msgspec.msgpack.encode(obj)
    return Signed(domain, bytes(key.verify_key), body, sign_bytes(key, domain, body))


def verify(signed: Signed, domain: str, type_: type[T], signer: bytes | None = None) -> T:
    """Check a :class:`Signed` and decode its body.

    Checks, in order: the domain, the expected signer (if given), the signature, then decodes the
    body as ``type_``. Each failure raises its own typed error; nothing else escapes.
    """
    if signed.domain != domain:
        raise WrongDomain(f"expected a {domain!r} signature, got {signed.domain!r}")
    if signer is not None and signed.signer != signer:
        raise WrongSigner(f"{domain} is signed by another key than expected")
    verify_bytes(signed.signer, domain, signed.body, signed.sig)
    return decode_struct(signed.body, type_, what=domain)


def decode_struct(data: bytes, type_: type[T], what: str) -> T:
    """msgpack-decode ``data`` as ``type_``, mapping every failure to :class:`DecodeError`."""
    try:
        return msgspec.msgpack.decode(data, type=type_)
    except (msgspec.DecodeError, msgspec.ValidationError, ValueError, TypeError, RecursionError) as exc:
        raise DecodeError(f"malformed {what}: {exc}") from exc


def encode_signed(signed: Signed) -> bytes:
    """Wire bytes of a :class:`Signed`."""
    return msgspec.msgpack.encode(signed)


def decode_signed(data: bytes, what: str = "signed object") -> Signed:
    """Parse wire bytes into a :class:`Signed` (structure only; call :func:`verify` next)."""
    signed = decode_struct(data, Signed, what)
    if len(signed.signer) != 32 or len(signed.sig) != SIGNATURE_SIZE:
        raise DecodeError(f"malformed {what}: bad key or signature length")
    return signed
