"""Meshes, invites, credentials, grants and revocations (sans-IO; ``now`` is always passed in).

A mesh is named by its key: ``mesh_id = "mesh-" + base32(sha256(mesh_pub))[:26]``. Whoever holds
the mesh key signs **invites** and **revocations**. Every record in a mesh carries its node's
**credential**, which any member can check with nothing but the mesh id (docs/identity.md):

* the owner's node holds an :class:`OwnerMembership`: the mesh key's signature naming that one
  node id. It carries no invite, so there is nothing in it anyone else could reuse;
* any other node holds a :class:`MembershipProof` (its own signature binding its id to the invite
  it presented) plus a :class:`Grant`: the signature of the member that admitted it first-hand,
  made when that member checked the invite *live* under the direct-join rules, and carrying the
  admitter's own credential, so the whole chain of admissions back to the owner can be checked.

An invite token is more than the signed invite: it carries the seed of the invite's own **joiner
key**, whose public half the mesh key signs into the invite. A joiner signs its node id with that key
(:attr:`MembershipProof.possession`), and a member admits first-hand only on that signature. Members'
credentials carry the signed invite (so anyone can check them) but never the seed, and a possession
signature names its one node id: nothing a member reads in gossip, or in a joiner's admission
exchange, lets another key join (issue 29: a revoked node re-keyed with an invite read from a record).

So a record enters a view only if its node was admitted, first-hand, by a member in good standing
who can be named. A malicious member can still admit nodes of its own (its grants are valid), but
every one of them is attributable to it, at most :data:`ADMISSIONS_PER_MEMBER` of them count at
any time, and revoking it voids every grant it signed. Invite use limits are counted over every
node this member knows to have used the invite (first-hand or from gossiped credentials).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import os
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, TypeVar

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
    WrongDomain,
    WrongMesh,
    WrongSigner,
)
from meshllm.identity.ids import b32, node_id, node_public_key
from meshllm.identity.keystore import KeystoreFile, decode_keystore, decrypt_keystore, encode_keystore
from meshllm.identity.signing import (
    CLOCK_SKEW_S,
    Signed,
    decode_signed,
    decode_struct,
    encode_signed,
    sign,
    sign_bytes,
    verify,
    verify_bytes,
)

MESH_ID_PREFIX = "mesh-"
MESH_ID_CHARS = 26
DEFAULT_INVITE_TTL_S = 24 * 3600.0
INVITE_ID_BYTES = 10
"""Random bytes in an invite id (16 base32 characters)."""
MAX_TOKEN_CHARS = 16 * 1024
SIGNATURE_CACHE = 8192
"""Exact signatures (of proofs, grants, owner memberships) remembered as verified."""
_T = TypeVar("_T")

INVITE_DOMAIN = "invite"
MEMBERSHIP_DOMAIN = "membership"
OWNER_DOMAIN = "owner-membership"
GRANT_DOMAIN = "grant"
REVOCATION_DOMAIN = "revocation"
INVITE_USE_DOMAIN = "invite-use"
"""What a joiner signs with the invite's joiner key: the mesh id and its node id."""
CREDENTIAL_MAX = 16 * 1024
"""Bytes of one credential (a chain of grants); a record is capped at 64 KiB in all."""
CHAIN_MAX = 8
"""Admitters between a node and the owner; a deeper chain is refused (join through the owner)."""
ADMISSIONS_PER_MEMBER = 32
"""Nodes a member other than the owner may have admitted (directly or down its chain) that count
here at any time. Bounds what one malicious member can make every member store."""


class NotAdmitted(VerificationError):
    """The credential carries no grant from a member (a node that has not joined through one)."""


class AdmitterQuota(VerificationError):
    """The member that admitted this node already has its quota of admitted nodes here."""


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
    joiner_key: bytes = b""
    """Public half of the invite's joiner key, whose seed only the token holds (empty: an invite made
    before issue 29, which no member admits first-hand any more)."""


class Invitation(msgspec.Struct, array_like=True, frozen=True, forbid_unknown_fields=True):
    """What an invite token holds: the signed invite and the seed of its joiner key (the secret part)."""

    invite: Signed
    seed: bytes = b""


class MembershipProof(msgspec.Struct, array_like=True, frozen=True, forbid_unknown_fields=True):
    """A node's signed claim: "I, node_id, join mesh_id with this invite". Part of its credential."""

    mesh_id: str
    node_id: str
    invite: Signed
    """The invite, exactly as the mesh key signed it."""
    joined: float
    """Unix time the node signed this claim."""
    possession: bytes = b""
    """The invite's joiner key's signature over ``[mesh_id, node_id]``: the joiner held the token, not
    just the signed invite; it is good for this node id only."""


class OwnerMembership(msgspec.Struct, array_like=True, frozen=True, forbid_unknown_fields=True):
    """Signed by the mesh key: ``node_id`` is the mesh owner's node (self-certified, no invite)."""

    mesh_id: str
    node_id: str
    issued: float


class Grant(msgspec.Struct, array_like=True, frozen=True, forbid_unknown_fields=True):
    """Signed by ``admitter``: it admitted ``node_id`` first-hand with ``invite_id`` at ``admitted``."""

    mesh_id: str
    node_id: str
    invite_id: str
    admitted: float
    admitter: str
    admitter_credential: bytes
    """The admitter's own credential, so its standing can be checked by anyone, recursively."""


class Credential(msgspec.Struct, array_like=True, frozen=True, forbid_unknown_fields=True):
    """What a record carries as its membership proof."""

    proof: bytes
    """A signed :class:`OwnerMembership` (the owner) or :class:`MembershipProof` (anyone else)."""
    grant: bytes = b""
    """The signed :class:`Grant` of the member that admitted us; empty until one did (or for the owner)."""


@dataclass(frozen=True)
class Standing:
    """Why a credential is good: ``via`` the owner's own membership or a grant."""

    node_id: str
    via: Literal["owner", "grant"]
    invite_id: str = ""
    max_uses: int = 0
    admitters: tuple[str, ...] = ()
    """Admitters in the chain other than the owner's node: each is charged for this node."""


RevocationTarget = Literal["invite", "node"]


class Revocation(msgspec.Struct, array_like=True, frozen=True, forbid_unknown_fields=True):
    """Signed by the mesh key: an invite id or a node id is no longer welcome."""

    mesh_id: str
    target_kind: RevocationTarget
    target: str
    issued: float
    closes: str = ""
    """With a node revocation: the invite that node joined with, closed to new joiners, so the
    node's operator cannot re-key and come back with it (members who joined with it stay)."""


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
               bootstrap: list[str] | None = None) -> Invitation:
        """Sign a new invite valid from ``now`` for ``ttl_s`` seconds, with a fresh joiner key."""
        if ttl_s <= 0 or max_uses < 0:
            raise ValueError("an invite needs a positive lifetime and a non-negative use count")
        joiner = SigningKey.generate()
        invite = Invite(self.mesh_id, self.public, b32(os.urandom(INVITE_ID_BYTES)), now, now + ttl_s, max_uses,
                        list(bootstrap or []), bytes(joiner.verify_key))
        return Invitation(sign(self.signing_key, INVITE_DOMAIN, invite), bytes(joiner))

    def revoke(self, target_kind: RevocationTarget, target: str, now: float, closes: str = "") -> Signed:
        """Sign a revocation of an invite id or a node id (``closes``: that node's invite)."""
        rev = Revocation(self.mesh_id, target_kind, target, now, closes)
        return sign(self.signing_key, REVOCATION_DOMAIN, rev)

    def owner_credential(self, node_id_text: str, now: float) -> bytes:
        """The credential of the owner's node: the mesh key names it, and nothing in it is reusable."""
        membership = sign(self.signing_key, OWNER_DOMAIN, OwnerMembership(self.mesh_id, node_id_text, now))
        return encode_credential(Credential(encode_signed(membership)))


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


def encode_token(invitation: Invitation) -> str:
    """The invitation as URL-safe text (base64url, no padding)."""
    return base64.urlsafe_b64encode(msgspec.msgpack.encode(invitation)).decode("ascii").rstrip("=")


def decode_token(token: str) -> Invitation:
    """Parse an invite token (structure only); :func:`verify_invite` checks its invite. A token made
    before issue 29 (the bare signed invite) decodes with no seed."""
    text = token.strip()
    if not text or len(text) > MAX_TOKEN_CHARS or not text.isascii():
        raise DecodeError("not an invite token", hint="copy the whole token printed by `meshllm invite create`")
    try:
        raw = base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))
    except (binascii.Error, ValueError) as exc:
        raise DecodeError("not an invite token (bad base64url)",
                          hint="copy the whole token printed by `meshllm invite create`") from exc
    try:
        return decode_struct(raw, Invitation, "invite token")
    except DecodeError:
        pass
    try:
        return Invitation(decode_signed(raw, "invite token"))
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
    return verify_invite(decode_token(token).invite)


def _possession_body(mesh_id: str, node: str) -> bytes:
    return msgspec.msgpack.encode([mesh_id, node])


def make_membership_proof(node_key: SigningKey, invitation: Invitation, now: float) -> bytes:
    """The joiner's proof: its node key's signature binding its id to the invite, with the invite's
    joiner key's signature over its node id (when the token holds the seed)."""
    inv = verify_invite(invitation.invite)
    node = node_id(bytes(node_key.verify_key))
    possession = b""
    if len(invitation.seed) == 32:
        possession = sign_bytes(SigningKey(invitation.seed), INVITE_USE_DOMAIN, _possession_body(inv.mesh_id, node))
    proof = MembershipProof(inv.mesh_id, node, invitation.invite, now, possession)
    return encode_signed(sign(node_key, MEMBERSHIP_DOMAIN, proof))


def joining_credential(node_key: SigningKey, invitation: Invitation, now: float) -> bytes:
    """The credential a joiner presents: its proof on the invitation, no grant yet."""
    return encode_credential(Credential(make_membership_proof(node_key, invitation, now)))


def make_grant(admitter_key: SigningKey, admitter_credential: bytes, mesh_id: str, joiner: str,
               invite_id: str, now: float) -> bytes:
    """What an admitting member signs for a joiner it admitted first-hand (sent back in Welcome)."""
    admitter = node_id(bytes(admitter_key.verify_key))
    grant = Grant(mesh_id, joiner, invite_id, now, admitter, admitter_credential)
    return encode_signed(sign(admitter_key, GRANT_DOMAIN, grant))


def encode_credential(credential: Credential) -> bytes:
    return msgspec.msgpack.encode(credential)


def decode_credential(data: bytes) -> Credential:
    """Parse a credential (structure only); :meth:`AdmissionState.standing` checks it."""
    if len(data) > CREDENTIAL_MAX:
        raise DecodeError(f"credential of {len(data)} bytes exceeds {CREDENTIAL_MAX}")
    return decode_struct(data, Credential, what="credential")


def with_grant(credential: bytes, grant: bytes) -> bytes:
    """``credential`` completed with the grant its node was given."""
    return encode_credential(msgspec.structs.replace(decode_credential(credential), grant=grant))


def grant_admitter(grant: bytes) -> str:
    """The admitter a signed grant names (structure only; :meth:`AdmissionState.standing` checks it)."""
    return decode_struct(decode_signed(grant, "grant").body, Grant, what="grant").admitter


def vouching_member(credential: bytes) -> str | None:
    """The member that admitted a credential's node first-hand, unless that is the owner's node (None
    then, and for the owner's own credential or one that does not parse). Structure only: for a
    credential already checked, to charge what its node costs to the member that vouched for it."""
    try:
        cred = decode_credential(credential)
        if not cred.grant:
            return None
        grant = decode_struct(decode_signed(cred.grant, "grant").body, Grant, what="grant")
        admitter = decode_signed(decode_credential(grant.admitter_credential).proof, "membership proof")
    except DecodeError:
        return None
    return None if admitter.domain == OWNER_DOMAIN else grant.admitter


def credential_invite_id(credential: bytes) -> str | None:
    """The invite id a credential was issued on (None for the owner's, or if it does not parse)."""
    try:
        signed = decode_signed(decode_credential(credential).proof, "membership proof")
        if signed.domain != MEMBERSHIP_DOMAIN:
            return None
        claimed = decode_struct(signed.body, MembershipProof, what="membership proof")
        return decode_struct(claimed.invite.body, Invite, what="invite").invite_id
    except DecodeError:
        return None


class AdmissionState:
    """One member's view of who may be in its mesh: revocations, invite uses, admitters' quotas.

    :meth:`standing` checks a credential and changes nothing. :meth:`verify_member` is the rule
    for every record and every peer we meet: a good standing, within its invite's use limit and
    its admitters' quotas as far as we know, which it then counts. :meth:`admit` is for a node
    joining *through us*: one already holding a good grant is simply a member; any other must
    present an invite that is live now (a use is counted) and gets a grant from us. Every check
    raises a typed :class:`VerificationError` and changes nothing on failure.
    """

    def __init__(self, mesh_id: str, mesh_pub: bytes) -> None:
        if mesh_id_for(mesh_pub) != mesh_id:
            raise WrongMesh(f"{mesh_id} is not the id of the given mesh key")
        self.mesh_id = mesh_id
        self.mesh_pub = mesh_pub
        self.revoked_invites: set[str] = set()
        self.closed_invites: set[str] = set()
        """Invites closed to new joiners (those of revoked nodes); their members stay."""
        self.revoked_nodes: set[str] = set()
        self._uses: dict[str, set[str]] = {}
        self._passive_uses: dict[str, int] = {}
        """Passive clients we admitted, per invite with a use limit: a count, never their ids (members hold
        nothing about passive clients), and weighed only when we admit a node ourselves: records that gossip
        brings are judged on the uses every member can see, so all members keep the same view."""
        self._charged: dict[str, set[str]] = {}
        """admitter -> nodes in its chains that we hold (bounded by ADMISSIONS_PER_MEMBER each)."""
        self._charges: dict[str, tuple[str, ...]] = {}
        self._sigs: OrderedDict[bytes, None] = OrderedDict()

    def uses(self, invite_id: str) -> int:
        """How many nodes this member knows to have joined with ``invite_id`` (passive clients it admitted too)."""
        return len(self._uses.get(invite_id, ())) + self._passive_uses.get(invite_id, 0)

    def admitted_by(self, admitter: str) -> int:
        """Nodes held here that ``admitter`` (a member other than the owner) admitted."""
        return len(self._charged.get(admitter, ()))

    def apply_revocation(self, data: bytes | Signed) -> Revocation:
        """Verify a revocation record (mesh key, this mesh) and apply it."""
        signed = data if isinstance(data, Signed) else decode_signed(data, "revocation")
        rev = verify(signed, REVOCATION_DOMAIN, Revocation, signer=self.mesh_pub)
        if rev.mesh_id != self.mesh_id:
            raise WrongMesh(f"revocation for {rev.mesh_id}, this node is in {self.mesh_id}")
        (self.revoked_invites if rev.target_kind == "invite" else self.revoked_nodes).add(rev.target)
        if rev.closes:
            self.closed_invites.add(rev.closes)
        return rev

    def check_invite(self, signed: Signed, now: float, joiner: str | None = None) -> Invite:
        """Is ``signed`` a live, unrevoked, not-used-up invite to this mesh (for ``joiner``)?"""
        invite = self._own_invite(signed)
        if invite.invite_id in self.closed_invites:
            raise InviteRevoked(f"invite {invite.invite_id} is closed to new joiners (a node that used it was revoked)",
                                hint="ask the mesh owner for a new invite")
        if now >= invite.expires:
            raise InviteExpired(f"invite {invite.invite_id} expired", hint="ask for a new invite")
        if now + CLOCK_SKEW_S < invite.issued:
            raise InviteExpired(f"invite {invite.invite_id} is not valid yet (check the clocks)")
        self._check_uses(invite.invite_id, invite.max_uses, joiner, self._passive_uses.get(invite.invite_id, 0))
        return invite

    def standing(self, node_id_text: str, credential: bytes, now: float, depth: int = 0) -> Standing:
        """Check a credential, its grant and the chain of admitters behind it. Changes nothing."""
        cred = decode_credential(credential)
        signed = decode_signed(cred.proof, "membership proof")
        if signed.domain == OWNER_DOMAIN:
            owner = self._verified(signed, OwnerMembership, self.mesh_pub)
            if owner.mesh_id != self.mesh_id:
                raise WrongMesh(f"owner membership of {owner.mesh_id}, this node is in {self.mesh_id}")
            if owner.node_id != node_id_text:
                raise VerificationError("owner membership names another node")
            self._check_not_revoked(node_id_text)
            return Standing(node_id_text, "owner")
        claimed = self._open_proof(node_id_text, signed)
        invite = self._own_invite(claimed.invite)
        if invite.invite_id in self.revoked_invites:
            raise InviteRevoked(f"node {node_id_text[:8]} joined with revoked invite {invite.invite_id}")
        if not cred.grant:
            raise NotAdmitted(f"node {node_id_text[:8]} was never admitted by a member",
                              hint="join through a member of the mesh (`meshllm join TOKEN`)")
        grant = self._verified(decode_signed(cred.grant, "grant"), Grant, None)
        if grant.mesh_id != self.mesh_id or grant.node_id != node_id_text or grant.invite_id != invite.invite_id:
            raise VerificationError(f"the grant of node {node_id_text[:8]} names another mesh, node or invite")
        if grant.admitter == node_id_text:
            raise VerificationError(f"node {node_id_text[:8]} admitted itself")
        if not invite.issued - CLOCK_SKEW_S <= grant.admitted <= invite.expires:
            raise InviteExpired(f"node {node_id_text[:8]} was admitted outside its invite's lifetime")
        if grant.admitted > now + CLOCK_SKEW_S:
            raise InviteExpired(f"node {node_id_text[:8]} claims an admission time in the future")
        if grant.admitter in self.revoked_nodes:
            raise NodeRevoked(f"node {node_id_text[:8]} was admitted by {grant.admitter[:8]}, "
                              "which the mesh owner revoked", hint="ask the mesh owner for a new invite")
        if depth + 1 >= CHAIN_MAX:
            raise VerificationError(f"node {node_id_text[:8]} sits {CHAIN_MAX} admissions from the owner",
                                    hint="join through the mesh owner's node")
        admitter = self.standing(grant.admitter, grant.admitter_credential, now, depth + 1)
        chain = () if admitter.via == "owner" else (grant.admitter, *admitter.admitters)
        return Standing(node_id_text, "grant", invite.invite_id, invite.max_uses, chain)

    def verify_member(self, node_id_text: str, credential: bytes, now: float) -> Standing:
        """The rule for every record and peer: a good standing within use limits and quotas (counted)."""
        standing = self.standing(node_id_text, credential, now)
        if standing.via == "grant":
            self._check_uses(standing.invite_id, standing.max_uses, node_id_text)
            for admitter in standing.admitters:
                held = self._charged.get(admitter, set())
                if node_id_text not in held and len(held) >= ADMISSIONS_PER_MEMBER:
                    raise AdmitterQuota(f"member {admitter[:8]} already admitted {len(held)} nodes held here")
            self._count(node_id_text, standing)
        return standing

    def admit(self, node_id_text: str, credential: bytes, now: float, quota_for: str | None = None,
              passive: bool = False) -> Invite | None:
        """A node joining through us. None: it already holds a good grant. Otherwise the invite it
        joins with, checked live and counted: the caller signs it a grant.

        ``quota_for`` is our own node id when we are not the owner: we then admit no more than
        :data:`ADMISSIONS_PER_MEMBER` nodes ourselves, as every member will count.
        ``passive``: a passive client. It takes a use of a limited invite like any node (it gets a credential
        that reaches every model of the mesh), counted here without its id; it needs no admitter quota (it
        enters no member's view).
        """
        try:
            self.verify_member(node_id_text, credential, now)
            return None
        except NodeRevoked:
            if node_id_text in self.revoked_nodes:
                raise
            # its admitter was revoked: it may still join afresh with a live invite
        except VerificationError:
            pass  # no (good) grant: the direct-join rules decide
        cred = decode_credential(credential)
        signed = decode_signed(cred.proof, "membership proof")
        if signed.domain != MEMBERSHIP_DOMAIN:
            raise WrongDomain(f"expected a {MEMBERSHIP_DOMAIN!r} proof to join with, got {signed.domain!r}")
        claimed = self._open_proof(node_id_text, signed)
        invite = self.check_invite(claimed.invite, now, joiner=node_id_text)
        self._check_possession(invite, claimed)
        if quota_for is not None:
            held = self._charged.get(quota_for, set())
            if node_id_text not in held and len(held) >= ADMISSIONS_PER_MEMBER:
                raise AdmitterQuota(f"this member already admitted {len(held)} nodes",
                                    hint="join through the mesh owner's node")
        if passive:
            if invite.max_uses:
                self._passive_uses[invite.invite_id] = self._passive_uses.get(invite.invite_id, 0) + 1
            return invite
        standing = Standing(node_id_text, "grant", invite.invite_id, invite.max_uses,
                            () if quota_for is None else (quota_for,))
        self._count(node_id_text, standing)
        return invite

    def forget(self, node_id_text: str) -> None:
        """``node_id_text`` left our table: it no longer counts against its admitters' quotas.

        Invite uses are not forgotten: a use limit is about the invite's whole life.
        """
        for admitter in self._charges.pop(node_id_text, ()):
            held = self._charged.get(admitter)
            if held is not None:
                held.discard(node_id_text)
                if not held:
                    del self._charged[admitter]

    # -- internals ----------------------------------------------------------------------------

    def _own_invite(self, signed: Signed) -> Invite:
        invite = verify_invite(signed)
        if invite.mesh_id != self.mesh_id or invite.mesh_pub != self.mesh_pub:
            raise WrongMesh(f"invite is for {invite.mesh_id}, this node is in {self.mesh_id}",
                            hint="ask a member of this mesh for an invite")
        if invite.invite_id in self.revoked_invites:
            raise InviteRevoked(f"invite {invite.invite_id} was revoked by the mesh owner",
                                hint="ask for a new invite")
        return invite

    def _check_possession(self, invite: Invite, claimed: MembershipProof) -> None:
        """The joiner held the token itself: the invite's joiner key signed its node id."""
        if not invite.joiner_key:
            raise NotAdmitted(f"invite {invite.invite_id} was made by an older version, without a joiner key",
                              hint="ask the mesh owner for a new invite")
        try:
            verify_bytes(invite.joiner_key, INVITE_USE_DOMAIN, _possession_body(self.mesh_id, claimed.node_id),
                         claimed.possession)
        except VerificationError:
            raise NotAdmitted(f"node {claimed.node_id[:8]} does not hold invite {invite.invite_id}'s token "
                              "(a signed invite read from the mesh admits nobody)",
                              hint="join with the whole token the mesh owner gave you") from None

    def _check_uses(self, invite_id: str, max_uses: int, joiner: str | None, passive: int = 0) -> None:
        """``passive``: uses by passive clients to count as well (when we admit a node ourselves)."""
        used_by = self._uses.get(invite_id, set())
        if max_uses and joiner not in used_by and len(used_by) + passive >= max_uses:
            raise InviteExhausted(f"invite {invite_id} was already used by {len(used_by) + passive} node(s)",
                                  hint="ask for a new invite, or create one with --uses N")

    def _count(self, node_id_text: str, standing: Standing) -> None:
        if standing.max_uses:
            self._uses.setdefault(standing.invite_id, set()).add(node_id_text)
        if self._charges.get(node_id_text) != standing.admitters:
            self.forget(node_id_text)
            for admitter in standing.admitters:
                self._charged.setdefault(admitter, set()).add(node_id_text)
            if standing.admitters:
                self._charges[node_id_text] = standing.admitters

    def _check_not_revoked(self, node_id_text: str) -> None:
        if node_id_text in self.revoked_nodes:
            raise NodeRevoked(f"node {node_id_text[:8]} was revoked by the mesh owner")

    def _open_proof(self, node_id_text: str, signed: Signed) -> MembershipProof:
        claimed = self._verified(signed, MembershipProof, node_public_key(node_id_text))
        if claimed.node_id != node_id_text:
            raise VerificationError("membership proof names another node")
        if claimed.mesh_id != self.mesh_id:
            raise WrongMesh(f"member of {claimed.mesh_id}, this node is in {self.mesh_id}")
        self._check_not_revoked(node_id_text)
        return claimed

    def _verified(self, signed: Signed, type_: type[_T], signer: bytes | None) -> _T:
        """Check domain, signer and signature (each exact signature once) and decode the body.

        ``signer`` None: a grant, whose signer is the admitter it names.
        """
        domain = {OwnerMembership: OWNER_DOMAIN, MembershipProof: MEMBERSHIP_DOMAIN, Grant: GRANT_DOMAIN}[type_]
        if signed.domain != domain:
            raise WrongDomain(f"expected a {domain!r} signature, got {signed.domain!r}")
        body = decode_struct(signed.body, type_, what=domain)
        expected = node_public_key(body.admitter) if isinstance(body, Grant) else signer
        if signed.signer != expected:
            raise WrongSigner(f"{domain} is not signed by the key it must be")
        key = signed.signer + signed.sig + signed.body
        if key in self._sigs:
            self._sigs.move_to_end(key)
        else:
            verify_bytes(signed.signer, signed.domain, signed.body, signed.sig)
            self._sigs[key] = None
            if len(self._sigs) > SIGNATURE_CACHE:
                self._sigs.popitem(last=False)
        return body
