"""The error hierarchy every layer raises from.

Every error a user can see names what failed and, through ``hint``, what to do about it. The CLI
prints ``str(error)`` (and the hint) as one line and exits 1; nothing below the CLI prints.
Security rejections are separate types so tests and logs can tell *why* something was refused.
"""

from __future__ import annotations


class MeshllmError(Exception):
    """Base of every error meshllm raises on purpose."""

    hint: str = ""

    def __init__(self, message: str, hint: str | None = None) -> None:
        super().__init__(message)
        if hint is not None:
            self.hint = hint


class ConfigError(MeshllmError):
    """The home folder, a config file or a command-line value is unusable."""


class DecodeError(MeshllmError):
    """Bytes from outside (a frame, a token, a record) could not be decoded into the expected type."""


class FrameTooLarge(DecodeError):
    """A frame announced a length above the cap for its stream."""


class VerificationError(MeshllmError):
    """A well-formed object failed a security check. Subclasses say which."""


class BadSignature(VerificationError):
    """The signature does not verify under the claimed key (forged or tampered)."""


class WrongDomain(VerificationError):
    """The object was signed for another purpose (domain tag) than the one expected."""


class WrongKind(VerificationError):
    """A signed envelope carries another message kind than the receiver expects."""


class WrongRecipient(VerificationError):
    """An envelope is addressed (and encrypted) to another node."""


class WrongSubject(VerificationError):
    """A certificate or proof is valid but is about another node than the one presenting it."""


class WrongSigner(VerificationError):
    """The object is validly signed, but by another key than the one it must come from."""


class Expired(VerificationError):
    """The object's lifetime has ended."""


class CertificateExpired(Expired):
    """The node certificate's lifetime has ended (or has not begun)."""


class InviteExpired(Expired):
    """The invite's lifetime has ended."""


class StaleTimestamp(VerificationError):
    """An envelope's timestamp lies outside the accepted window around the receiver's clock."""


class ReplayedEnvelope(VerificationError):
    """The same envelope was already accepted inside the replay window."""


class NonceReused(VerificationError):
    """A different envelope from the same sender reused a nonce seen inside the replay window."""


class Revoked(VerificationError):
    """Something was revoked. Subclasses say what."""


class InviteRevoked(Revoked):
    """The invite was revoked by the mesh key."""


class CertificateRevoked(Revoked):
    """The node certificate was revoked."""


class NodeRevoked(Revoked):
    """The node id was revoked (by the mesh or by local trust policy)."""


class OwnerRevoked(Revoked):
    """The owner key that signed the certificate was revoked."""


class WrongMesh(VerificationError):
    """The object belongs to another mesh than this node's."""


class InviteExhausted(VerificationError):
    """The invite has already been used its maximum number of times."""


class Untrusted(VerificationError):
    """The peer is valid but the local trust policy does not accept it."""


class KeystoreError(MeshllmError):
    """The owner keystore is missing, corrupt or the passphrase is wrong."""
