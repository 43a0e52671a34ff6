"""The node key: an Ed25519 key whose public half *is* the node id.

The key file holds the raw 32-byte seed and nothing else, mode 0600. A key file that is readable
by others, or has the wrong size, is refused rather than silently fixed: either means something
touched it that should not have, and the operator must decide (restore, ``chmod 600``, or delete it
to get a new identity).
"""

from __future__ import annotations

from pathlib import Path

from nacl.signing import SigningKey

from meshllm.config import NODE_KEY_FILE, create_private, ensure_home, read_private
from meshllm.errors import ConfigError
from meshllm.identity.ids import node_id

SEED_SIZE = 32


class NodeKey:
    """A node's signing key plus the two forms of its public key that callers need."""

    def __init__(self, signing_key: SigningKey) -> None:
        self.signing_key = signing_key
        self.public: bytes = bytes(signing_key.verify_key)
        """Raw Ed25519 public key (32 bytes)."""
        self.node_id: str = node_id(self.public)
        """Lowercase unpadded base32 of :attr:`public`."""

    def __repr__(self) -> str:
        # Never show the secret half, even in a debugger or a log line.
        return f"NodeKey({self.node_id})"

    @classmethod
    def ephemeral(cls) -> NodeKey:
        """A fresh key that is never written anywhere (``--ephemeral``, tests)."""
        return cls(SigningKey.generate())

    @classmethod
    def load(cls, home: Path) -> NodeKey:
        """Read the node key from ``home``; :class:`ConfigError` if missing or unusable."""
        path = home / NODE_KEY_FILE
        try:
            seed = read_private(path, "node key")
        except FileNotFoundError:
            raise ConfigError(f"no node key at {path}", hint="run `meshllm auth status` or start a node once") \
                from None
        if len(seed) != SEED_SIZE:
            raise ConfigError(f"node key {path} has {len(seed)} bytes, expected {SEED_SIZE}",
                              hint="restore it from a backup, or delete it to create a new node identity")
        return cls(SigningKey(seed))

    @classmethod
    def load_or_create(cls, home: Path) -> NodeKey:
        """Load the node key, creating it on first use.

        Creation is race-free (:func:`~meshllm.config.create_private`): if another process created
        the key first, that key wins.
        """
        path = ensure_home(home) / NODE_KEY_FILE
        if path.exists():
            return cls.load(home)
        key = SigningKey.generate()
        if not create_private(path, bytes(key)):
            return cls.load(home)
        return cls(key)
