"""Signed envelopes: one-shot messages between nodes, authenticated, fresh and never replayed.

An envelope is ``[v, kind, sender, recipient, ts_ms, nonce, payload, sig]`` in msgpack. The
signature covers the ``envelope`` domain tag and every other field, so a message cannot be
re-labelled (kind), re-addressed (recipient), re-dated or altered. ``recipient`` is empty for an
envelope anyone may read; when set, the payload is encrypted to that node with a nacl ``Box``
(Curve25519 keys converted from both Ed25519 keys), and only that node accepts the envelope.

:class:`EnvelopeReceiver` is sans-IO: it is given bytes and the time and keeps a bounded replay
cache. Checks run cheapest first, and state changes only once every check has passed.
"""

from __future__ import annotations

import hashlib
import heapq
import os
from dataclasses import dataclass

import msgspec
from nacl.exceptions import CryptoError
from nacl.public import Box
from nacl.signing import VerifyKey

from meshllm.errors import (
    DecodeError,
    NonceReused,
    ReplayedEnvelope,
    StaleTimestamp,
    WrongKind,
    WrongRecipient,
)
from meshllm.identity.ids import node_id as node_id_of
from meshllm.identity.ids import node_public_key
from meshllm.identity.keys import NodeKey
from meshllm.identity.signing import SIGNATURE_SIZE, decode_struct, sign_bytes, verify_bytes

ENVELOPE_VERSION = 1
ENVELOPE_DOMAIN = "envelope"
NONCE_SIZE = 16
DEFAULT_WINDOW_S = 60.0
DEFAULT_MAX_ENTRIES = 100_000


class Envelope(msgspec.Struct, array_like=True, frozen=True):
    """An envelope on the wire."""

    v: int
    """Format version; only :data:`ENVELOPE_VERSION`."""
    kind: str
    """Message kind, e.g. ``"down-notice"``; the receiver says which kind it expects."""
    sender: bytes
    """Sender's Ed25519 public key (its node id, raw)."""
    recipient: bytes
    """Recipient's Ed25519 public key, or empty for an unaddressed, unencrypted envelope."""
    ts_ms: int
    """Sender's clock, Unix milliseconds."""
    nonce: bytes
    """16 random bytes; unique per sender inside the replay window."""
    payload: bytes
    """The message; Box ciphertext when ``recipient`` is set."""
    sig: bytes
    """Ed25519 signature over the domain tag and the msgpack of all other fields."""


@dataclass(frozen=True)
class OpenedEnvelope:
    """An envelope that passed every check, with its payload in the clear."""

    kind: str
    sender: str
    """Sender node id."""
    ts_ms: int
    nonce: bytes
    payload: bytes
    encrypted: bool
    """Whether the payload travelled encrypted to this node."""


def _signed_part(v: int, kind: str, sender: bytes, recipient: bytes, ts_ms: int, nonce: bytes,
                 payload: bytes) -> bytes:
    return msgspec.msgpack.encode((v, kind, sender, recipient, ts_ms, nonce, payload))


def seal(key: NodeKey, kind: str, payload: bytes, now: float, recipient: str | None = None,
         nonce: bytes | None = None) -> bytes:
    """Sign (and, given a recipient node id, encrypt) ``payload`` as an envelope of ``kind``.

    ``nonce`` is for tests; leave it None to get a random one.
    """
    nonce = os.urandom(NONCE_SIZE) if nonce is None else nonce
    if len(nonce) != NONCE_SIZE:
        raise ValueError(f"an envelope nonce has {NONCE_SIZE} bytes")
    to = b""
    if recipient is not None:
        to = node_public_key(recipient)
        box = Box(key.signing_key.to_curve25519_private_key(), VerifyKey(to).to_curve25519_public_key())
        payload = bytes(box.encrypt(payload))
    ts_ms = int(now * 1000)
    body = _signed_part(ENVELOPE_VERSION, kind, key.public, to, ts_ms, nonce, payload)
    sig = sign_bytes(key.signing_key, ENVELOPE_DOMAIN, body)
    return msgspec.msgpack.encode(Envelope(ENVELOPE_VERSION, kind, key.public, to, ts_ms, nonce, payload, sig))


def decode_envelope(data: bytes) -> Envelope:
    """Parse envelope bytes (structure and field sizes only); :class:`DecodeError` otherwise."""
    env = decode_struct(data, Envelope, "envelope")
    if len(env.sender) != 32 or len(env.recipient) not in (0, 32) or len(env.nonce) != NONCE_SIZE \
            or len(env.sig) != SIGNATURE_SIZE:
        raise DecodeError("malformed envelope: bad key, nonce or signature length")
    return env


class EnvelopeReceiver:
    """Opens envelopes for one node, rejecting stale, replayed and nonce-reusing ones.

    The replay cache maps ``(sender, nonce)`` to a digest of the accepted envelope's fields and the
    last instant its timestamp is inside the window (``ts_ms + window``); after that the timestamp
    check alone rejects it, so the entry can go. If more than ``max_entries`` envelopes are fresh
    at once, the one that goes stale first is dropped early and the *floor* rises to its timestamp:
    envelopes not newer than the floor are then refused as stale, because the cache can no longer
    prove they are not replays.
    """

    def __init__(self, key: NodeKey | None = None, window_s: float = DEFAULT_WINDOW_S,
                 max_entries: int = DEFAULT_MAX_ENTRIES) -> None:
        if max_entries < 1 or window_s <= 0:
            raise ValueError("an envelope receiver needs a positive window and room for at least one entry")
        self._key = key
        self._window_ms = int(window_s * 1000)
        self._max_entries = max_entries
        self._seen: dict[tuple[bytes, bytes], tuple[bytes, int]] = {}
        self._expiry: list[tuple[int, bytes, bytes]] = []
        self._floor_ms: int | None = None

    def __len__(self) -> int:
        return len(self._seen)

    def open(self, data: bytes, expected_kind: str, now: float) -> OpenedEnvelope:
        """Check ``data`` completely; return its contents or raise the typed reason."""
        env = decode_envelope(data)
        if env.v != ENVELOPE_VERSION:
            raise DecodeError(f"envelope version {env.v} is not supported (expected {ENVELOPE_VERSION})")
        if env.kind != expected_kind:
            raise WrongKind(f"expected a {expected_kind!r} envelope, got {env.kind[:40]!r}")
        now_ms = int(now * 1000)
        self._check_fresh(env.ts_ms, now_ms)
        body = _signed_part(env.v, env.kind, env.sender, env.recipient, env.ts_ms, env.nonce, env.payload)
        digest = hashlib.blake2b(body + env.sig, digest_size=16).digest()
        slot = (env.sender, env.nonce)
        prior = self._seen.get(slot)
        if prior is not None and prior[1] < now_ms:
            prior = None  # stale entry not yet evicted: that nonce may be used again
        if prior is not None and prior[0] == digest:
            raise ReplayedEnvelope(f"envelope from {node_id_of(env.sender)[:8]} was already received")
        verify_bytes(env.sender, ENVELOPE_DOMAIN, body, env.sig)
        key = self._key
        if env.recipient and (key is None or env.recipient != key.public):
            raise WrongRecipient(f"envelope from {node_id_of(env.sender)[:8]} is addressed to another node")
        if prior is not None:
            raise NonceReused(f"node {node_id_of(env.sender)[:8]} reused a nonce inside the replay window")
        payload = self._decrypt(key, env) if key is not None and env.recipient else env.payload
        self._remember(slot, digest, env.ts_ms + self._window_ms, now_ms)
        return OpenedEnvelope(env.kind, node_id_of(env.sender), env.ts_ms, env.nonce, payload,
                              bool(env.recipient))

    def _check_fresh(self, ts_ms: int, now_ms: int) -> None:
        if abs(now_ms - ts_ms) > self._window_ms:
            raise StaleTimestamp(f"envelope timestamp is {(ts_ms - now_ms) / 1000:+.1f} s from this node's "
                                 f"clock (window ±{self._window_ms / 1000:g} s)",
                                 hint="check that both machines' clocks are synchronised")
        if self._floor_ms is not None and ts_ms <= self._floor_ms:
            raise StaleTimestamp("envelope is older than the replay cache can vouch for (cache full)")

    @staticmethod
    def _decrypt(key: NodeKey, env: Envelope) -> bytes:
        try:
            box = Box(key.signing_key.to_curve25519_private_key(), VerifyKey(env.sender).to_curve25519_public_key())
            return box.decrypt(env.payload)
        except (CryptoError, ValueError, TypeError) as exc:
            raise DecodeError("envelope payload does not decrypt (sender encrypted it wrongly)") from exc

    def _remember(self, slot: tuple[bytes, bytes], digest: bytes, expires_ms: int, now_ms: int) -> None:
        while self._expiry and (self._expiry[0][0] < now_ms or len(self._seen) >= self._max_entries):
            expires, sender, nonce = heapq.heappop(self._expiry)
            entry = self._seen.get((sender, nonce))
            if entry is None or entry[1] != expires:
                continue  # superseded by a later acceptance of the same slot
            del self._seen[(sender, nonce)]
            if expires >= now_ms:  # evicted while still fresh: raise the floor
                floor = expires - self._window_ms
                self._floor_ms = floor if self._floor_ms is None else max(self._floor_ms, floor)
        self._seen[slot] = (digest, expires_ms)
        heapq.heappush(self._expiry, (expires_ms, slot[0], slot[1]))
