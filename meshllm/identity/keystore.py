"""The owner keystore: the owner's Ed25519 key encrypted under a passphrase.

The same format seals a mesh key when its owner wants it encrypted at rest (``meshllm mesh
encrypt``); ``what`` names the file in errors.

The secret is sealed with ``SecretBox`` under a key stretched from the passphrase by argon2id.
The file is a small versioned JSON document; its public key is in the clear so ``auth status`` can
show the owner without asking for the passphrase. The KDF limits are stored in the file, bounded on
read, and bound to the ciphertext (other limits give another key, so decryption fails): a tampered
header can neither weaken the KDF silently nor make unlocking allocate unbounded memory.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import msgspec
import nacl.pwhash.argon2id as argon2id
import nacl.secret
import nacl.utils
from nacl.exceptions import CryptoError
from nacl.signing import SigningKey

from meshllm.config import write_private
from meshllm.errors import DecodeError, KeystoreError

KEYSTORE_VERSION = 1
PASSPHRASE_ENV = "MESHLLM_OWNER_PASSPHRASE"
OWNER_KEYSTORE = "owner keystore"

# About 0.15 s on a small 2-core machine: slow for guessing, quick enough for a CLI command.
DEFAULT_OPSLIMIT = 3
DEFAULT_MEMLIMIT = 64 * 1024 * 1024
# Bounds accepted on read, so a crafted file cannot make unlocking hang or exhaust memory.
MAX_OPSLIMIT = 16
MAX_MEMLIMIT = 1024 * 1024 * 1024

_SEALED_SIZE = nacl.secret.SecretBox.NONCE_SIZE + nacl.secret.SecretBox.MACBYTES + 32


class KeystoreFile(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The keystore on disk (JSON; bytes fields are base64)."""

    v: int
    """Format version; only :data:`KEYSTORE_VERSION` is understood."""
    kdf: str
    """Always ``"argon2id"``."""
    opslimit: int
    """argon2id passes."""
    memlimit: int
    """argon2id memory in bytes."""
    salt: bytes
    """16 random bytes for the KDF."""
    public: bytes
    """The owner public key (32 bytes), readable without the passphrase."""
    sealed: bytes
    """SecretBox output (nonce, MAC, ciphertext) of the 32-byte Ed25519 seed."""


def encode_keystore(key: SigningKey, passphrase: str, *, opslimit: int = DEFAULT_OPSLIMIT,
                    memlimit: int = DEFAULT_MEMLIMIT) -> bytes:
    """Encrypt ``key`` under ``passphrase`` and return the file's bytes."""
    if not passphrase:
        raise KeystoreError("refusing an empty passphrase", hint="choose a passphrase you can remember")
    salt = nacl.utils.random(argon2id.SALTBYTES)
    box = nacl.secret.SecretBox(_derive(passphrase, salt, opslimit, memlimit))
    ks = KeystoreFile(KEYSTORE_VERSION, "argon2id", opslimit, memlimit, salt, bytes(key.verify_key),
                      bytes(box.encrypt(bytes(key))))
    return msgspec.json.encode(ks)


def decode_keystore(data: bytes, what: str = OWNER_KEYSTORE) -> KeystoreFile:
    """Parse and bound-check a keystore file; :class:`DecodeError` on anything malformed."""
    try:
        ks = msgspec.json.decode(data, type=KeystoreFile)
    except (msgspec.DecodeError, msgspec.ValidationError, ValueError, TypeError, RecursionError) as exc:
        raise DecodeError(f"malformed {what}: {exc}") from exc
    if ks.v != KEYSTORE_VERSION:
        raise DecodeError(f"{what} version {ks.v} is not supported (expected {KEYSTORE_VERSION})")
    problems = [
        ks.kdf != "argon2id" and f"unknown kdf {ks.kdf!r}",
        not argon2id.OPSLIMIT_MIN <= ks.opslimit <= MAX_OPSLIMIT and "opslimit out of range",
        not argon2id.MEMLIMIT_MIN <= ks.memlimit <= MAX_MEMLIMIT and "memlimit out of range",
        len(ks.salt) != argon2id.SALTBYTES and "bad salt length",
        len(ks.public) != 32 and "bad public key length",
        len(ks.sealed) != _SEALED_SIZE and "bad ciphertext length",
    ]
    found = [p for p in problems if p]
    if found:
        raise DecodeError(f"malformed {what}: {', '.join(found)}")
    return ks


def decrypt_keystore(ks: KeystoreFile, passphrase: str, what: str = OWNER_KEYSTORE,
                     env: str = PASSPHRASE_ENV) -> SigningKey:
    """The key inside ``ks``; :class:`KeystoreError` if the passphrase (from ``env`` or typed) is wrong."""
    box = nacl.secret.SecretBox(_derive(passphrase, ks.salt, ks.opslimit, ks.memlimit))
    try:
        seed = box.decrypt(ks.sealed)
    except CryptoError:
        raise KeystoreError(f"wrong passphrase for the {what} (or the file was altered)",
                            hint=f"check {env} or retype the passphrase") from None
    key = SigningKey(seed)
    if bytes(key.verify_key) != ks.public:
        raise KeystoreError(f"{what} is inconsistent: its public key does not match its secret",
                            hint="restore it from a backup")
    return key


def read_keystore(path: Path) -> KeystoreFile:
    """Read the keystore header (no passphrase needed); :class:`KeystoreError` if missing or corrupt."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise KeystoreError(f"no owner keystore at {path}", hint="create one with `meshllm auth init`") from None
    except OSError as exc:
        raise KeystoreError(f"cannot read owner keystore {path}: {exc.strerror}") from exc
    try:
        return decode_keystore(data)
    except DecodeError as exc:
        raise KeystoreError(f"{path}: {exc}", hint="restore the keystore from a backup") from exc


def create_keystore(path: Path, passphrase: str, *, force: bool = False, opslimit: int = DEFAULT_OPSLIMIT,
                    memlimit: int = DEFAULT_MEMLIMIT) -> SigningKey:
    """Generate an owner key and store it encrypted at ``path`` (mode 0600, atomic)."""
    if path.exists() and not force:
        raise KeystoreError(f"an owner keystore already exists at {path}",
                            hint="pass --force to replace it (the old owner key is lost)")
    key = SigningKey.generate()
    write_private(path, encode_keystore(key, passphrase, opslimit=opslimit, memlimit=memlimit))
    return key


def unlock_keystore(path: Path, passphrase: str) -> SigningKey:
    """Read and decrypt the owner key at ``path``."""
    return decrypt_keystore(read_keystore(path), passphrase)


def obtain_passphrase(*, confirm: bool, prompt: Callable[[bool], str] | None, env: str = PASSPHRASE_ENV,
                      what: str = OWNER_KEYSTORE) -> str:
    """The passphrase from the environment variable ``env``, else from ``prompt(confirm)``.

    ``prompt`` is None when there is no terminal to ask on; then there is no way to get a
    passphrase, and saying so beats hanging on a read that never completes.
    """
    value = os.environ.get(env)
    if value is not None:
        return value
    if prompt is None:
        raise KeystoreError(f"the {what} needs a passphrase, and there is no terminal to ask on",
                            hint=f"set {env} or run the command in a terminal")
    return prompt(confirm)


def _derive(passphrase: str, salt: bytes, opslimit: int, memlimit: int) -> bytes:
    return argon2id.kdf(nacl.secret.SecretBox.KEY_SIZE, passphrase.encode("utf-8", "surrogateescape"), salt,
                        opslimit=opslimit, memlimit=memlimit)
