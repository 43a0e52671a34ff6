"""Every admission rule: each refusal has its own typed error, and refusals change nothing."""

from __future__ import annotations

import msgspec
import pytest
from nacl.signing import SigningKey

from meshllm.errors import (
    BadSignature,
    DecodeError,
    InviteExhausted,
    InviteExpired,
    InviteRevoked,
    NodeRevoked,
    VerificationError,
    WrongDomain,
    WrongMesh,
    WrongSigner,
)
from meshllm.identity.ids import node_id
from meshllm.identity.signing import Signed, decode_signed, sign
from meshllm.mesh.admission import (
    AdmissionState,
    Invite,
    MeshKey,
    decode_token,
    encode_token,
    inspect_token,
    is_mesh_id,
    make_membership_proof,
    mesh_id_for,
)

NOW = 1_800_000_000.0


@pytest.fixture
def mesh() -> MeshKey:
    return MeshKey.generate()


@pytest.fixture
def state(mesh: MeshKey) -> AdmissionState:
    return AdmissionState(mesh.mesh_id, mesh.public)


def joiner(mesh: MeshKey, invite: Signed, at: float = NOW) -> tuple[str, bytes]:
    key = SigningKey.generate()
    return node_id(bytes(key.verify_key)), make_membership_proof(key, invite, at)


def test_mesh_id_shape_and_derivation(mesh: MeshKey) -> None:
    assert is_mesh_id(mesh.mesh_id)
    assert len(mesh.mesh_id) == len("mesh-") + 26
    assert mesh.mesh_id == mesh_id_for(mesh.public)
    assert MeshKey.generate().mesh_id != mesh.mesh_id
    assert not is_mesh_id("mesh-ABC") and not is_mesh_id("node-" + mesh.mesh_id[5:])


def test_mesh_key_round_trips_through_home(tmp_path, mesh: MeshKey) -> None:
    path = mesh.save(tmp_path)
    assert path.stat().st_mode & 0o777 == 0o600
    assert MeshKey.load(tmp_path).mesh_id == mesh.mesh_id
    assert MeshKey.load(tmp_path / "empty") is None


def test_valid_invite_admits_and_token_round_trips(mesh: MeshKey, state: AdmissionState) -> None:
    token = encode_token(mesh.invite(NOW, bootstrap=["127.0.0.1:9338"]))
    inv = inspect_token(token)
    assert inv.mesh_id == mesh.mesh_id and inv.bootstrap == ["127.0.0.1:9338"]
    nid, proof = joiner(mesh, decode_token(token))
    claimed = state.admit(nid, proof, NOW + 10)
    assert claimed.node_id == nid and state.uses(inv.invite_id) == 1
    assert state.verify_member(nid, proof, NOW + 10 * 86400).node_id == nid


def test_expired_invite_refused(mesh: MeshKey, state: AdmissionState) -> None:
    invite = mesh.invite(NOW, ttl_s=60)
    nid, proof = joiner(mesh, invite)
    with pytest.raises(InviteExpired):
        state.admit(nid, proof, NOW + 61)
    assert state.uses(inspect_token(encode_token(invite)).invite_id) == 0
    state.admit(nid, proof, NOW + 59)


def test_member_who_joined_after_expiry_is_refused_later(mesh: MeshKey, state: AdmissionState) -> None:
    nid, proof = joiner(mesh, mesh.invite(NOW, ttl_s=60), at=NOW + 3600)
    with pytest.raises(InviteExpired):
        state.verify_member(nid, proof, NOW + 3600)


def test_over_used_invite_refused_but_same_node_may_rejoin(mesh: MeshKey, state: AdmissionState) -> None:
    invite = mesh.invite(NOW, max_uses=1)
    first, first_proof = joiner(mesh, invite)
    state.admit(first, first_proof, NOW)
    second, second_proof = joiner(mesh, invite)
    with pytest.raises(InviteExhausted):
        state.admit(second, second_proof, NOW)
    state.admit(first, first_proof, NOW + 1)
    inv_id = inspect_token(encode_token(invite)).invite_id
    assert state.uses(inv_id) == 1


def test_unlimited_invite(mesh: MeshKey, state: AdmissionState) -> None:
    invite = mesh.invite(NOW, max_uses=0)
    for _ in range(5):
        state.admit(*joiner(mesh, invite), NOW)


def test_invite_of_another_mesh_refused(state: AdmissionState) -> None:
    other = MeshKey.generate()
    nid, proof = joiner(other, other.invite(NOW))
    with pytest.raises(WrongMesh):
        state.admit(nid, proof, NOW)
    with pytest.raises(WrongMesh):
        state.verify_member(nid, proof, NOW)


def test_revoked_invite_refused_everywhere(mesh: MeshKey, state: AdmissionState) -> None:
    invite = mesh.invite(NOW, max_uses=0)
    nid, proof = joiner(mesh, invite)
    state.admit(nid, proof, NOW)
    state.apply_revocation(mesh.revoke("invite", inspect_token(encode_token(invite)).invite_id, NOW))
    with pytest.raises(InviteRevoked):
        state.admit(*joiner(mesh, invite), NOW)
    with pytest.raises(InviteRevoked):
        state.verify_member(nid, proof, NOW)


def test_revoked_node_refused(mesh: MeshKey, state: AdmissionState) -> None:
    nid, proof = joiner(mesh, mesh.invite(NOW, max_uses=0))
    state.apply_revocation(mesh.revoke("node", nid, NOW))
    with pytest.raises(NodeRevoked):
        state.admit(nid, proof, NOW)
    with pytest.raises(NodeRevoked):
        state.verify_member(nid, proof, NOW)


def test_revocation_signed_by_another_key_refused(mesh: MeshKey, state: AdmissionState) -> None:
    forged = MeshKey.generate().revoke("node", "x", NOW)
    with pytest.raises(WrongSigner):
        state.apply_revocation(forged)
    assert not state.revoked_nodes


def test_tampered_token_refused(mesh: MeshKey) -> None:
    signed = mesh.invite(NOW, ttl_s=60)
    inv = inspect_token(encode_token(signed))
    longer = Invite(inv.mesh_id, inv.mesh_pub, inv.invite_id, inv.issued, inv.expires + 86400 * 365,
                    inv.max_uses, inv.bootstrap)
    tampered = Signed(signed.domain, signed.signer, msgspec.msgpack.encode(longer), signed.sig)
    with pytest.raises(BadSignature):
        inspect_token(encode_token(tampered))


def test_forged_invite_signed_by_other_key_refused(mesh: MeshKey, state: AdmissionState) -> None:
    attacker = SigningKey.generate()
    inv = inspect_token(encode_token(mesh.invite(NOW)))
    forged = sign(attacker, "invite", inv)
    with pytest.raises(WrongSigner):
        inspect_token(encode_token(forged))


def test_wrong_domain_refused(mesh: MeshKey) -> None:
    inv = inspect_token(encode_token(mesh.invite(NOW)))
    as_revocation = sign(mesh.signing_key, "revocation", inv)
    with pytest.raises(WrongDomain):
        inspect_token(encode_token(as_revocation))


def test_proof_signed_by_another_node_refused(mesh: MeshKey, state: AdmissionState) -> None:
    invite = mesh.invite(NOW)
    _, proof = joiner(mesh, invite)
    impostor = node_id(bytes(SigningKey.generate().verify_key))
    with pytest.raises(WrongSigner):
        state.admit(impostor, proof, NOW)
    assert state.uses(inspect_token(encode_token(invite)).invite_id) == 0


@pytest.mark.parametrize("token", ["", "!!!", "a" * 20000, "bG9s", "ünicode"])
def test_garbage_tokens_are_decode_errors(token: str) -> None:
    with pytest.raises(DecodeError):
        decode_token(token)


def test_refusals_are_verification_errors(mesh: MeshKey, state: AdmissionState) -> None:
    nid, proof = joiner(mesh, mesh.invite(NOW, ttl_s=1))
    with pytest.raises(VerificationError):
        state.admit(nid, proof, NOW + 2)
    with pytest.raises(DecodeError):
        state.admit(nid, b"\x00garbage", NOW)
    with pytest.raises(DecodeError):
        decode_signed(b"")
