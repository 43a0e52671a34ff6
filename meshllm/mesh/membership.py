"""How a starting node becomes a member: own a mesh (create or reuse its key) or join with an invite.

Either way the result is a :class:`Membership`: the mesh id and key, our membership proof (which
goes into our peer record), and the addresses to dial first. A mesh owner admits itself with an
invite it signs for itself, so every record in a mesh — the owner's included — carries the same
kind of proof.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from nacl.signing import SigningKey

from meshllm.errors import ConfigError
from meshllm.mesh.admission import (
    AdmissionState,
    MeshKey,
    decode_token,
    encode_token,
    make_membership_proof,
    verify_invite,
)

SELF_INVITE_TTL_S = 10 * 365 * 86400.0
"""The owner's own invite outlives any run; it admits nobody else (one use, by the owner)."""


@dataclass
class Membership:
    """This node's place in a mesh."""

    mesh_id: str
    mesh_pub: bytes
    proof: bytes
    """Our membership proof (encoded ``Signed``), carried in our peer record."""
    mesh_key: MeshKey | None = None
    """Held when this node owns the mesh: it can then sign invites and revocations."""
    bootstrap: list[str] = field(default_factory=list)
    """``host:port`` addresses to dial at start (from the invite we joined with)."""

    def admission(self) -> AdmissionState:
        """A fresh admission state for this mesh."""
        return AdmissionState(self.mesh_id, self.mesh_pub)

    def new_invite(self, now: float, ttl_s: float, max_uses: int, bootstrap: list[str]) -> str:
        """A token for a new invite; only the owner can make one."""
        if self.mesh_key is None:
            raise ConfigError("only the node that holds the mesh key can create invites",
                              hint="run `meshllm invite create --api URL` against the mesh owner's node")
        return encode_token(self.mesh_key.invite(now, ttl_s, max_uses, bootstrap))


def own_mesh(node_key: SigningKey, home: Path | None, now: float) -> Membership:
    """Reuse the mesh key in ``home`` (or create and save one); ``home=None`` keeps it in memory."""
    key = MeshKey.load(home) if home is not None else None
    if key is None:
        key = MeshKey.generate()
        if home is not None:
            key.save(home)
    self_invite = key.invite(now, SELF_INVITE_TTL_S, max_uses=1)
    return Membership(key.mesh_id, key.public, make_membership_proof(node_key, self_invite, now), mesh_key=key)


def join_mesh(node_key: SigningKey, token: str, now: float) -> Membership:
    """Membership from an invite token (checked for signature and shape; members check the rest)."""
    signed = decode_token(token)
    invite = verify_invite(signed)
    return Membership(invite.mesh_id, invite.mesh_pub, make_membership_proof(node_key, signed, now),
                      bootstrap=list(invite.bootstrap))
