"""How a starting node becomes a member: own a mesh (create or reuse its key) or join with an invite.

Either way the result is a :class:`Membership`: the mesh id and key, our credential (which goes
into our peer record), and the addresses to dial first. The owner's node holds a credential the
mesh key signs for its node id alone; a joiner holds its proof on an invite, completed by the
grant of the member that admits it (:meth:`Membership.take_grant`). A joiner keeps its completed
credential in its home, so it can come back after a restart once its invite has expired.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

from nacl.signing import SigningKey

from meshllm.config import write_private
from meshllm.errors import ConfigError, MeshllmError, VerificationError
from meshllm.identity.ids import node_id
from meshllm.mesh.admission import (
    AdmissionState,
    Invite,
    MeshKey,
    decode_credential,
    decode_token,
    encode_token,
    grant_admitter,
    joining_credential,
    verify_invite,
    with_grant,
)

log = logging.getLogger(__name__)

CREDENTIAL_FILE = "credential.msgpack"
"""A joiner's completed credential (proof and grant), kept in its home across restarts."""


@dataclass
class Membership:
    """This node's place in a mesh."""

    mesh_id: str
    mesh_pub: bytes
    proof: bytes
    """Our credential (encoded), carried in our peer record and presented at admission."""
    mesh_key: MeshKey | None = None
    """Held when this node owns the mesh: it can then sign invites and revocations."""
    bootstrap: list[str] = field(default_factory=list)
    """``host:port`` addresses to dial at start (from the invite we joined with)."""
    credential_file: Path | None = None
    """Where a granted credential is saved (None: memory only)."""

    def admission(self) -> AdmissionState:
        """A fresh admission state for this mesh."""
        return AdmissionState(self.mesh_id, self.mesh_pub)

    @property
    def granted(self) -> bool:
        """True when our credential needs no grant from a member (the owner's) or already has one."""
        return self.mesh_key is not None or bool(decode_credential(self.proof).grant)

    def take_grant(self, node: str, admitter: str, grant: bytes, now: float) -> bool:
        """Complete our credential with the grant ``admitter`` gave us; True when it was new.

        The completed credential must hold up under the rules every member applies (checked here),
        so a member that hands us a bad grant cannot leave us with a credential nobody accepts.
        """
        if self.granted or not grant:
            return False
        credential = with_grant(self.proof, grant)
        self.admission().standing(node, credential, now)
        if grant_admitter(grant) != admitter:
            raise VerificationError(f"the grant from {admitter[:8]} names another member as its admitter")
        self.proof = credential
        if self.credential_file is not None:
            try:
                write_private(self.credential_file, credential)
            except OSError as exc:
                log.warning("cannot save our credential to %s: %s", self.credential_file, exc)
        return True

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
    credential = key.owner_credential(node_id(bytes(node_key.verify_key)), now)
    return Membership(key.mesh_id, key.public, credential, mesh_key=key)


def join_mesh(node_key: SigningKey, token: str, now: float, home: Path | None = None) -> Membership:
    """Membership from an invite token (checked for signature and shape; members check the rest).

    With ``home``, a credential an earlier run was granted on the same invite is reused.
    """
    invitation = decode_token(token)
    invite = verify_invite(invitation.invite)
    credential = joining_credential(node_key, invitation, now)
    path = None if home is None else home / CREDENTIAL_FILE
    saved = _saved_credential(path, node_id(bytes(node_key.verify_key)), invite, now)
    return Membership(invite.mesh_id, invite.mesh_pub, saved or credential, bootstrap=list(invite.bootstrap),
                      credential_file=path)


def _saved_credential(path: Path | None, node: str, invite: Invite, now: float) -> bytes | None:
    """The saved credential if it is ours, granted, and on the invite we join with now."""
    if path is None or not path.exists():
        return None
    try:
        data = path.read_bytes()
        standing = AdmissionState(invite.mesh_id, invite.mesh_pub).standing(node, data, now)
    except (OSError, MeshllmError) as exc:
        log.info("not reusing the saved credential in %s: %s", path, exc)
        return None
    return data if standing.invite_id == invite.invite_id else None
