"""Text forms of public keys: node ids and mesh ids.

A node id *is* the node's Ed25519 public key, printed as lowercase base32 without padding (52
characters), so it can be checked against a TLS certificate or a signature with no lookup.
"""

from __future__ import annotations

import base64
import binascii

from meshllm.errors import DecodeError

PUBLIC_KEY_SIZE = 32


def b32(data: bytes) -> str:
    """Lowercase base32 without padding."""
    return base64.b32encode(data).decode("ascii").rstrip("=").lower()


def unb32(text: str) -> bytes:
    """Inverse of :func:`b32`; raises :class:`DecodeError` on anything that is not base32."""
    if not isinstance(text, str) or not text.isascii():
        raise DecodeError("not base32 text")
    padded = text.upper() + "=" * (-len(text) % 8)
    try:
        return base64.b32decode(padded)
    except (binascii.Error, ValueError) as exc:
        raise DecodeError(f"not base32 text: {text[:20]!r}") from exc


def node_id(public_key: bytes) -> str:
    """The node id for an Ed25519 public key."""
    if len(public_key) != PUBLIC_KEY_SIZE:
        raise DecodeError(f"an Ed25519 public key has 32 bytes, not {len(public_key)}")
    return b32(public_key)


def node_public_key(node_id_text: str) -> bytes:
    """The Ed25519 public key a node id names."""
    key = unb32(node_id_text)
    if len(key) != PUBLIC_KEY_SIZE:
        raise DecodeError(f"a node id names a 32-byte key; {node_id_text[:20]!r} does not")
    return key


def short(node_id_text: str) -> str:
    """The first 8 characters of an id: enough for humans, not for security decisions."""
    return node_id_text[:8]
