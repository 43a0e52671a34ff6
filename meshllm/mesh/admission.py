"""Meshes, invites, membership proofs and revocations (sans-IO; ``now`` is always passed in).

A mesh is named by its key: ``mesh_id = "mesh-" + base32(sha256(mesh_pub))[:26]``. Whoever holds
the mesh key signs **invites**; a node joins by presenting one together with its own signature
binding its node id to that invite (a **membership proof**). The proof travels in the node's peer
record, so every member can check any record first-hand or gossiped, with nothing but the mesh id.
**Revocations** (of an invite or a node id) are records signed by the mesh key.

Use limits (``max_uses``) are counted by each admitting member for the joiners *it* admits; a
joiner that comes back with the same invite does not use it up again. See docs/identity.md.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import os
from pathlib import Path
from typing import Literal

import msgspec
from nacl.signing import SigningKey

from meshllm.config import MESH_KEY_FILE, read_private, write_private
from meshllm.errors import (
    DecodeError,
    InviteExhausted,
    InviteExpired,
    InviteRevoked,
    KeystoreError,
    NodeRevoked,
    VerificationError,
    WrongMesh,
    WrongSigner,
)
from meshllm.identity.ids import b32, node_id, node_public_key
from meshllm.identity.keystore import KeystoreFile, decode_keystore, decrypt_keystore, encode_keystore
from meshllm.identity.signing import CLOCK_SKEW_S, Signed, decode_signed, encode_signed, sign, verify

MESH_ID_PREFIX = "mesh-"
MESH_ID_CHARS = 26
DEFAULT_INVITE_TTL_S = 24 * 3600.0
INVITE_ID_BYTES = 10
"""Random bytes in an invite id (16 base32 characters)."""
MAX_TOKEN_CHARS = 16 * 1024

INVITE_DOMAIN = "invite"
MEMBERSHIP_DOMAIN = "membership"
REVOCATION_DOMAIN = "revocation"


def mesh_id_for(mesh_pub: bytes) -> str:
    """The mesh id named by a mesh public key."""
    return MESH_ID_PREFIX + b32(hashlib.sha256(mesh_pub).digest())[:MESH_ID_CHARS]


def is_mesh_id(text: str) -> bool:
    """Whether ``text`` has the shape of a mesh id (``mesh-`` + 26 base32 characters)."""
    body = text[len(MESH_ID_PREFIX):]
    return (text.startswith(MESH_ID_PREFIX) and len(body) == MESH_ID_CHARS
            and all(c in "abcdefghijklmnopqrstuvwxyz234567" for c in body))


class Invite(msgspec.Struct, array_like=True, frozen=True, forbid_unknown_fields=True):
    """What the mesh key signs to let nodes in."""

    mesh_id: str
    """The mesh this invite admits to; must equal ``mesh_id_for(mesh_pub)``."""
    mesh_pub: bytes
    """The mesh public key; members check every invite with it."""
    invite_id: str
    """Random id (base32), the handle for use counting and revocation."""
    issued: float
    """Unix time the invite was signed."""
    expires: float
    """Unix time after which nobody may join with it."""
    max_uses: int
    """How many distinct nodes may join with it (0: unlimited, for published meshes)."""
    bootstrap: list[str]
    """``host:port`` UDP addresses of members to dial."""


class MembershipProof(msgspec.Struct, array_like=True, frozen=True, forbid_unknown_fields=True):
    """A node's signed claim: "I, node_id, joined mesh_id with this invite". Carried in its record."""

    mesh_id: str
    node_id: str
    invite: Signed
    """The invite, exactly as the mesh key signed it."""
    joined: float
    """Unix time of joining; must lie inside the invite's lifetime."""


RevocationTarget = Literal["invite", "node"]


class Revocation(msgspec.Struct, array_like=True, frozen=True, forbid_unknown_fields=True):
    """Signed by the mesh key: an invite id or a node id is no longer welcome."""

    mesh_id: str
    target_kind: RevocationTarget
    target: str
    issued: float


MESH_PASSPHRASE_ENV = "MESHLLM_MESH_PASSPHRASE"
"""Where a node finds the passphrase of an encrypted mesh key (``meshllm serve`` prompts on a terminal)."""
MESH_KEY_WHAT = "mesh key"


class MeshKey:
    """The key that defines a mesh. Whoever holds it can invite and revoke.

    At rest (``$MESHLLM_HOME/mesh.key``, mode 0600) it is either the raw 32-byte seed or, when the
    owner asked for it (``meshllm mesh encrypt``), the owner-keystore format: the seed sealed under
    a passphrase stretched by argon2id (:mod:`meshllm.identity.keystore`). A file other users can
    read is refused, like the node key: the mesh may already be someone else's.
    """

    def __init__(self, signing_key: SigningKey) -> None:
        self.signing_key = signing_key
        self.public = bytes(signing_key.verify_key)
        self.mesh_id = mesh_id_for(self.public)

    @classmethod
    def generate(cls) -> MeshKey:
        return cls(SigningKey.generate())

    @classmethod
    def load(cls, home: Path, passphrase: str | None = None) -> MeshKey | None:
        """The mesh key in ``home``, or ``None`` when this node never created a mesh.

        An encrypted key is unlocked with ``passphrase``, else with ``$MESHLLM_MESH_PASSPHRASE``;
        without either it is a :class:`~meshllm.errors.KeystoreError` that says so.
        """
        path = home / MESH_KEY_FILE
        stored = _read_mesh_key(path)
        if stored is None:
            return None
        if isinstance(stored, bytes):
            return cls(SigningKey(stored))
        if passphrase is None:
            passphrase = os.environ.get(MESH_PASSPHRASE_ENV)
        if passphrase is None:
            raise KeystoreError(f"mesh key {path} is encrypted and no passphrase was given",
                                hint=f"set {MESH_PASSPHRASE_ENV}, or start the node in a terminal to type it")
        return cls(decrypt_keystore(stored, passphrase, MESH_KEY_WHAT, MESH_PASSPHRASE_ENV))

    @staticmethod
    def stored(home: Path) -> tuple[bytes, bool] | None:
        """``(mesh public key, encrypted)`` of the key in ``home`` without unlocking it; ``None`` if absent."""
        stored = _read_mesh_key(home / MESH_KEY_FILE)
        if stored is None:
            return None
        if isinstance(stored, bytes):
            return bytes(SigningKey(stored).verify_key), False
        return stored.public, True

    def save(self, home: Path, passphrase: str | None = None) -> Path:
        """Write the key to ``home`` (0600, atomic); sealed under ``passphrase`` when one is given."""
        path = home / MESH_KEY_FILE
        data = encode_keystore(self.signing_key, passphrase) if passphrase is not None else self.signing_key.encode()
        write_private(path, data)
        return path

    def invite(self, now: float, ttl_s: float = DEFAULT_INVITE_TTL_S, max_uses: int = 1,
               bootstrap: list[str] | None = None) -> Signed:
        """Sign a new invite valid from ``now`` for ``ttl_s`` seconds."""
        if ttl_s <= 0 or max_uses < 0:
            raise ValueError("an invite needs a positive lifetime and a non-negative use count")
        invite = Invite(self.mesh_id, self.public, b32(os.urandom(INVITE_ID_BYTES)), now, now + ttl_s, max_uses,
                        list(bootstrap or []))
        return sign(self.signing_key, INVITE_DOMAIN, invite)

    def revoke(self, target_kind: RevocationTarget, target: str, now: float) -> Signed:
        """Sign a revocation of an invite id or a node id."""
        return sign(self.signing_key, REVOCATION_DOMAIN, Revocation(self.mesh_id, target_kind, target, now))


def _read_mesh_key(path: Path) -> bytes | KeystoreFile | None:
    """The raw seed or the sealed keystore in ``path``; ``None`` if there is no file."""
    try:
        data = read_private(path, MESH_KEY_WHAT)
    except FileNotFoundError:
        return None
    if len(data) == 32:
        return data
    try:
        return decode_keystore(data, MESH_KEY_WHAT)
    except DecodeError:
        raise DecodeError(f"{path} is not a mesh key (neither a 32-byte seed nor an encrypted key)",
                          hint="restore it from a backup; without it this mesh can no longer invite") from None


def encode_token(invite: Signed) -> str:
    """The invite as URL-safe text (base64url, no padding)."""
    return base64.urlsafe_b64encode(encode_signed(invite)).decode("ascii").rstrip("=")


def decode_token(token: str) -> Signed:
    """Parse an invite token (structure only); :func:`verify_invite` checks it."""
    text = token.strip()
    if not text or len(text) > MAX_TOKEN_CHARS or not text.isascii():
        raise DecodeError("not an invite token", hint="copy the whole token printed by `meshllm invite create`")
    try:
        raw = base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))
    except (binascii.Error, ValueError) as exc:
        raise DecodeError("not an invite token (bad base64url)",
                          hint="copy the whole token printed by `meshllm invite create`") from exc
    try:
        return decode_signed(raw, "invite token")
    except DecodeError:
        raise DecodeError("not an invite token (it does not decode)",
                          hint="copy the whole token printed by `meshllm invite create`") from None


def verify_invite(signed: Signed) -> Invite:
    """Check an invite's signature against the mesh key it names, and that key against its mesh id.

    Says nothing about time, revocation or uses: :class:`AdmissionState` checks those.
    """
    invite = verify(signed, INVITE_DOMAIN, Invite)
    if signed.signer != invite.mesh_pub:
        raise WrongSigner("invite is not signed by the mesh key it names")
    if mesh_id_for(invite.mesh_pub) != invite.mesh_id:
        raise WrongMesh(f"invite names {invite.mesh_id} but carries the key of {mesh_id_for(invite.mesh_pub)}")
    if invite.expires <= invite.issued or invite.max_uses < 0:
        raise DecodeError("invite has an empty lifetime or a negative use count")
    return invite


def inspect_token(token: str) -> Invite:
    """Decode and signature-check a token (no time or mesh checks): for ``meshllm invite inspect``."""
    return verify_invite(decode_token(token))


def make_membership_proof(node_key: SigningKey, invite: Signed, now: float) -> bytes:
    """The joiner's proof: its node key's signature binding its id to ``invite``."""
    inv = verify_invite(invite)
    proof = MembershipProof(inv.mesh_id, node_id(bytes(node_key.verify_key)), invite, now)
    return encode_signed(sign(node_key, MEMBERSHIP_DOMAIN, proof))


class AdmissionState:
    """One member's view of who may be in its mesh: revocations and invite uses.

    ``admit`` is for a node joining *through us* (the invite must be live now, and a use is
    counted); ``verify_member`` is for any record we meet later (the proof must have been made
    while its invite was live, and nothing in it may be revoked). Both raise a typed
    :class:`VerificationError` and change nothing on failure.
    """

    def __init__(self, mesh_id: str, mesh_pub: bytes) -> None:
        if mesh_id_for(mesh_pub) != mesh_id:
            raise WrongMesh(f"{mesh_id} is not the id of the given mesh key")
        self.mesh_id = mesh_id
        self.mesh_pub = mesh_pub
        self.revoked_invites: set[str] = set()
        self.revoked_nodes: set[str] = set()
        self._uses: dict[str, set[str]] = {}

    def uses(self, invite_id: str) -> int:
        """How many distinct nodes this member has admitted with ``invite_id``."""
        return len(self._uses.get(invite_id, ()))

    def apply_revocation(self, data: bytes | Signed) -> Revocation:
        """Verify a revocation record (mesh key, this mesh) and apply it."""
        signed = data if isinstance(data, Signed) else decode_signed(data, "revocation")
        rev = verify(signed, REVOCATION_DOMAIN, Revocation, signer=self.mesh_pub)
        if rev.mesh_id != self.mesh_id:
            raise WrongMesh(f"revocation for {rev.mesh_id}, this node is in {self.mesh_id}")
        (self.revoked_invites if rev.target_kind == "invite" else self.revoked_nodes).add(rev.target)
        return rev

    def check_invite(self, signed: Signed, now: float, joiner: str | None = None) -> Invite:
        """Is ``signed`` a live, unrevoked, not-used-up invite to this mesh (for ``joiner``)?"""
        invite = verify_invite(signed)
        if invite.mesh_id != self.mesh_id or invite.mesh_pub != self.mesh_pub:
            raise WrongMesh(f"invite is for {invite.mesh_id}, this node is in {self.mesh_id}",
                            hint="ask a member of this mesh for an invite")
        if invite.invite_id in self.revoked_invites:
            raise InviteRevoked(f"invite {invite.invite_id} was revoked by the mesh owner",
                                hint="ask for a new invite")
        if now >= invite.expires:
            raise InviteExpired(f"invite {invite.invite_id} expired", hint="ask for a new invite")
        if now + CLOCK_SKEW_S < invite.issued:
            raise InviteExpired(f"invite {invite.invite_id} is not valid yet (check the clocks)")
        used_by = self._uses.get(invite.invite_id, set())
        if invite.max_uses and joiner not in used_by and len(used_by) >= invite.max_uses:
            raise InviteExhausted(f"invite {invite.invite_id} was already used {len(used_by)} time(s)",
                                  hint="ask for a new invite, or create one with --uses N")
        return invite

    def _open_proof(self, node_id_text: str, proof: bytes) -> MembershipProof:
        signed = decode_signed(proof, "membership proof")
        claimed = verify(signed, MEMBERSHIP_DOMAIN, MembershipProof, signer=node_public_key(node_id_text))
        if claimed.node_id != node_id_text:
            raise VerificationError("membership proof names another node")
        if claimed.mesh_id != self.mesh_id:
            raise WrongMesh(f"member of {claimed.mesh_id}, this node is in {self.mesh_id}")
        if node_id_text in self.revoked_nodes:
            raise NodeRevoked(f"node {node_id_text[:8]} was revoked by the mesh owner")
        return claimed

    def admit(self, node_id_text: str, proof: bytes, now: float) -> MembershipProof:
        """Admit a node joining through us now: its proof must hold a live invite; counts a use."""
        claimed = self._open_proof(node_id_text, proof)
        invite = self.check_invite(claimed.invite, now, joiner=node_id_text)
        self._uses.setdefault(invite.invite_id, set()).add(node_id_text)
        return claimed

    def verify_member(self, node_id_text: str, proof: bytes, now: float) -> MembershipProof:
        """Check a member's proof as carried in its record (first-hand or gossiped)."""
        claimed = self._open_proof(node_id_text, proof)
        invite = verify_invite(claimed.invite)
        if invite.mesh_id != self.mesh_id or invite.mesh_pub != self.mesh_pub:
            raise WrongMesh(f"membership proof carries an invite of {invite.mesh_id}")
        if invite.invite_id in self.revoked_invites:
            raise InviteRevoked(f"node {node_id_text[:8]} joined with revoked invite {invite.invite_id}")
        if not invite.issued - CLOCK_SKEW_S <= claimed.joined <= invite.expires:
            raise InviteExpired(f"node {node_id_text[:8]} claims to have joined outside its invite's lifetime")
        if claimed.joined > now + CLOCK_SKEW_S:
            raise InviteExpired(f"node {node_id_text[:8]} claims a join time in the future")
        return claimed
