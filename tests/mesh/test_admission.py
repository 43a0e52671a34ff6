"""Every admission rule: each refusal has its own typed error, and refusals change nothing."""

from __future__ import annotations

import copy

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
from meshllm.identity.signing import Signed, decode_signed, decode_struct, encode_signed, sign
from meshllm.mesh.admission import (
    ADMISSIONS_PER_MEMBER,
    CHAIN_MAX,
    GRANT_DOMAIN,
    AdmissionState,
    AdmitterQuota,
    Credential,
    Grant,
    Invitation,
    Invite,
    MembershipProof,
    MeshKey,
    NotAdmitted,
    credential_invite_id,
    decode_credential,
    decode_token,
    encode_credential,
    encode_token,
    inspect_token,
    is_mesh_id,
    joining_credential,
    make_grant,
    mesh_id_for,
    with_grant,
)

NOW = 1_800_000_000.0


class Member:
    """A node key with its credential."""

    def __init__(self, key: SigningKey, credential: bytes) -> None:
        self.key, self.credential = key, credential
        self.id = node_id(bytes(key.verify_key))


@pytest.fixture
def mesh() -> MeshKey:
    return MeshKey.generate()


@pytest.fixture
def state(mesh: MeshKey) -> AdmissionState:
    return AdmissionState(mesh.mesh_id, mesh.public)


@pytest.fixture
def owner(mesh: MeshKey) -> Member:
    key = SigningKey.generate()
    return Member(key, mesh.owner_credential(node_id(bytes(key.verify_key)), NOW))


def invite_id(invite: Invitation) -> str:
    return inspect_token(encode_token(invite)).invite_id


def applicant(invite: Invitation, at: float = NOW) -> Member:
    """A fresh node holding a joining credential (no grant yet)."""
    key = SigningKey.generate()
    return Member(key, joining_credential(key, invite, at))


def admitted(state: AdmissionState, admitter: Member, invite: Invitation, at: float = NOW,
             quota_for: str | None = None) -> Member:
    """A fresh node admitted through ``admitter`` the way the mesh service does it."""
    node = applicant(invite, at)
    inv = state.admit(node.id, node.credential, at, quota_for=quota_for)
    assert inv is not None
    grant = make_grant(admitter.key, admitter.credential, state.mesh_id, node.id, inv.invite_id, at)
    node.credential = with_grant(node.credential, grant)
    return node


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


def test_owner_credential_names_one_node_and_holds_no_invite(mesh: MeshKey, state: AdmissionState,
                                                             owner: Member) -> None:
    assert state.verify_member(owner.id, owner.credential, NOW).via == "owner"
    assert credential_invite_id(owner.credential) is None  # nothing in it a member could reuse
    stranger = node_id(bytes(SigningKey.generate().verify_key))
    with pytest.raises(VerificationError, match="another node"):
        state.verify_member(stranger, owner.credential, NOW)
    with pytest.raises(WrongSigner):  # another mesh key's owner membership
        state.verify_member(owner.id, MeshKey.generate().owner_credential(owner.id, NOW), NOW)


def test_valid_invite_admits_and_the_grant_outlives_it(mesh: MeshKey, state: AdmissionState, owner: Member) -> None:
    token = encode_token(mesh.invite(NOW, ttl_s=60, bootstrap=["127.0.0.1:9338"]))
    inv = inspect_token(token)
    assert inv.mesh_id == mesh.mesh_id and inv.bootstrap == ["127.0.0.1:9338"]
    node = admitted(state, owner, decode_token(token), NOW + 10)
    assert state.uses(inv.invite_id) == 1
    assert credential_invite_id(node.credential) == inv.invite_id
    # A day later the invite is long expired, but the grant made while it was live still holds,
    # for this member and for any other that checks the gossiped credential.
    later = AdmissionState(mesh.mesh_id, mesh.public)
    assert later.verify_member(node.id, node.credential, NOW + 86400).admitters == ()
    assert state.admit(node.id, node.credential, NOW + 86400) is None  # a member, nothing to grant


def test_expired_invite_refused_and_counts_nothing(mesh: MeshKey, state: AdmissionState, owner: Member) -> None:
    invite = mesh.invite(NOW, ttl_s=60)
    node = applicant(invite)
    with pytest.raises(InviteExpired):
        state.admit(node.id, node.credential, NOW + 61)
    assert state.uses(invite_id(invite)) == 0
    assert state.admit(node.id, node.credential, NOW + 59) is not None


def test_a_credential_without_grant_is_not_a_member(mesh: MeshKey, state: AdmissionState) -> None:
    node = applicant(mesh.invite(NOW))
    with pytest.raises(NotAdmitted):
        state.verify_member(node.id, node.credential, NOW)


def test_a_grant_dated_outside_the_invites_life_is_refused(mesh: MeshKey, state: AdmissionState,
                                                           owner: Member) -> None:
    invite = mesh.invite(NOW, ttl_s=60)
    for when in (NOW - 3600, NOW + 3600):  # backdated before the invite, or after it expired
        node = applicant(invite, when)
        grant = make_grant(owner.key, owner.credential, mesh.mesh_id, node.id, invite_id(invite), when)
        with pytest.raises(InviteExpired):
            state.verify_member(node.id, with_grant(node.credential, grant), NOW + 7200)


def test_use_limit_counts_every_use_this_member_knows(mesh: MeshKey, state: AdmissionState, owner: Member) -> None:
    invite = mesh.invite(NOW, max_uses=1)
    first = admitted(state, owner, invite)
    second = applicant(invite)
    with pytest.raises(InviteExhausted):
        state.admit(second.id, second.credential, NOW)
    assert state.admit(first.id, first.credential, NOW + 1) is None  # the same node may come back
    assert state.uses(invite_id(invite)) == 1
    # Another member learns the use from the first node's gossiped credential ...
    other = AdmissionState(mesh.mesh_id, mesh.public)
    other.verify_member(first.id, first.credential, NOW)
    with pytest.raises(InviteExhausted):
        other.admit(second.id, second.credential, NOW)
    # ... and refuses a second node's record on the used-up invite, whoever granted it.
    forged_grant = make_grant(owner.key, owner.credential, mesh.mesh_id, second.id, invite_id(invite), NOW)
    with pytest.raises(InviteExhausted):
        other.verify_member(second.id, with_grant(second.credential, forged_grant), NOW)


def test_a_passive_client_takes_a_use_of_the_member_that_admits_it(mesh: MeshKey, state: AdmissionState,
                                                                   owner: Member) -> None:
    """A passive client gets a credential that reaches every model: it takes a use of a limited invite, or a
    one-use invite would admit any number of API clients. Only the member that admits it counts it, and only
    for its own admissions: a member node's gossiped record on that invite is still judged on the uses every
    member can see, so views agree."""
    invite = mesh.invite(NOW, max_uses=2)
    first, second, third = applicant(invite), applicant(invite), applicant(invite)
    assert state.admit(first.id, first.credential, NOW, passive=True) is not None
    assert state.admit(second.id, second.credential, NOW, passive=True) is not None
    assert state.uses(invite_id(invite)) == 2
    for passive in (True, False):
        with pytest.raises(InviteExhausted):
            state.admit(third.id, third.credential, NOW, passive=passive)
    assert state.uses(invite_id(invite)) == 2  # a refusal changes nothing
    # another member, which never heard of the passive clients, admitted a member node with the same invite:
    other = AdmissionState(mesh.mesh_id, mesh.public)
    member = admitted(other, owner, invite)
    assert state.verify_member(member.id, member.credential, NOW).invite_id == invite_id(invite)


def test_unlimited_invite(mesh: MeshKey, state: AdmissionState, owner: Member) -> None:
    invite = mesh.invite(NOW, max_uses=0)
    for _ in range(5):
        admitted(state, owner, invite)
    assert state.uses(invite_id(invite)) == 0  # nothing to count


def test_invite_of_another_mesh_refused(state: AdmissionState) -> None:
    other = MeshKey.generate()
    node = applicant(other.invite(NOW))
    with pytest.raises(WrongMesh):
        state.admit(node.id, node.credential, NOW)
    with pytest.raises(WrongMesh):
        state.verify_member(node.id, node.credential, NOW)


def test_revoked_invite_refused_everywhere(mesh: MeshKey, state: AdmissionState, owner: Member) -> None:
    invite = mesh.invite(NOW, max_uses=0)
    node = admitted(state, owner, invite)
    state.apply_revocation(mesh.revoke("invite", invite_id(invite), NOW))
    late = applicant(invite)
    with pytest.raises(InviteRevoked):
        state.admit(late.id, late.credential, NOW)
    with pytest.raises(InviteRevoked):
        state.verify_member(node.id, node.credential, NOW)


def test_revoking_a_node_voids_what_it_admitted_and_closes_its_invite(mesh: MeshKey, state: AdmissionState,
                                                                      owner: Member) -> None:
    live = mesh.invite(NOW, ttl_s=3600, max_uses=0)
    expired = mesh.invite(NOW - 7200, ttl_s=60, max_uses=0)
    bad = admitted(state, owner, live)
    honest = admitted(state, bad, live)
    sybil = applicant(expired, NOW - 7190)  # admitted by `bad` with an invite long expired (backdated)
    grant = make_grant(bad.key, bad.credential, mesh.mesh_id, sybil.id, invite_id(expired), NOW - 7190)
    sybil.credential = with_grant(sybil.credential, grant)
    assert state.verify_member(sybil.id, sybil.credential, NOW).admitters == (bad.id,)  # attributable
    state.apply_revocation(mesh.revoke("node", bad.id, NOW, closes=invite_id(live)))
    for node in (bad, honest, sybil):
        with pytest.raises(NodeRevoked):
            state.verify_member(node.id, node.credential, NOW)
    # Re-keying does not get the revoked operator back in with the invite it joined with ...
    rekeyed = applicant(live)
    with pytest.raises(InviteRevoked, match="closed"):
        state.admit(rekeyed.id, rekeyed.credential, NOW)
    # ... and members that joined with that invite through someone else stay.
    other = admitted(AdmissionState(mesh.mesh_id, mesh.public), owner, live)
    assert state.verify_member(other.id, other.credential, NOW).via == "grant"


def test_a_node_admitted_by_a_revoked_member_may_join_again_with_a_live_invite(
        mesh: MeshKey, state: AdmissionState, owner: Member) -> None:
    invite = mesh.invite(NOW, max_uses=0)
    bad = admitted(state, owner, invite)
    honest = admitted(state, bad, invite)
    state.apply_revocation(mesh.revoke("node", bad.id, NOW))
    assert state.admit(honest.id, honest.credential, NOW) is not None  # to be granted afresh
    with pytest.raises(NodeRevoked):
        state.admit(bad.id, bad.credential, NOW)


def test_revoked_node_refused(mesh: MeshKey, state: AdmissionState, owner: Member) -> None:
    node = admitted(state, owner, mesh.invite(NOW, max_uses=0))
    state.apply_revocation(mesh.revoke("node", node.id, NOW))
    with pytest.raises(NodeRevoked):
        state.admit(node.id, node.credential, NOW)
    with pytest.raises(NodeRevoked):
        state.verify_member(node.id, node.credential, NOW)


def test_revocation_signed_by_another_key_refused(mesh: MeshKey, state: AdmissionState) -> None:
    forged = MeshKey.generate().revoke("node", "x", NOW)
    with pytest.raises(WrongSigner):
        state.apply_revocation(forged)
    assert not state.revoked_nodes


def bad_grants(mesh: MeshKey, owner: Member, node: Member, inv: str) -> dict[str, tuple[bytes, type[Exception]]]:
    """Grants a forger could try, each with the error it must meet."""
    stranger = SigningKey.generate()
    real = make_grant(owner.key, owner.credential, mesh.mesh_id, node.id, inv, NOW)
    as_owner = Grant(mesh.mesh_id, node.id, inv, NOW, owner.id, owner.credential)
    other_node = node_id(bytes(SigningKey.generate().verify_key))
    return {
        "signed by another key": (encode_signed(sign(stranger, GRANT_DOMAIN, as_owner)), WrongSigner),
        "tampered": (real[:-1] + bytes([real[-1] ^ 1]), BadSignature),
        "names another node": (make_grant(owner.key, owner.credential, mesh.mesh_id, other_node, inv, NOW),
                               VerificationError),
        "names another invite": (make_grant(owner.key, owner.credential, mesh.mesh_id, node.id, "a" * 16, NOW),
                                 VerificationError),
        "admitter with no standing": (make_grant(stranger, b"", mesh.mesh_id, node.id, inv, NOW), DecodeError),
        "admitter not admitted": (make_grant(stranger, joining_credential(stranger, mesh.invite(NOW), NOW),
                                             mesh.mesh_id, node.id, inv, NOW), NotAdmitted),
        "self-admitted": (make_grant(node.key, node.credential, mesh.mesh_id, node.id, inv, NOW), VerificationError),
        "wrong domain": (encode_signed(sign(owner.key, "membership", as_owner)), WrongDomain),
        "garbage": (b"\x93\x00\x01", DecodeError),
        "future": (make_grant(owner.key, owner.credential, mesh.mesh_id, node.id, inv, NOW + 3 * 3600), InviteExpired),
    }


GRANT_CASES = ["signed by another key", "tampered", "names another node", "names another invite",
               "admitter with no standing", "admitter not admitted", "self-admitted", "wrong domain", "garbage",
               "future"]


@pytest.mark.parametrize("case", GRANT_CASES)
def test_forged_grants_are_refused_and_change_nothing(mesh: MeshKey, state: AdmissionState, owner: Member,
                                                      case: str) -> None:
    invite = mesh.invite(NOW, ttl_s=7200, max_uses=1)
    node = applicant(invite)
    grant, error = bad_grants(mesh, owner, node, invite_id(invite))[case]
    before = copy.deepcopy((state._uses, state._charged))
    with pytest.raises(error):
        state.verify_member(node.id, with_grant(node.credential, grant), NOW)
    assert (state._uses, state._charged) == before


def test_a_member_may_admit_only_its_quota(mesh: MeshKey, state: AdmissionState, owner: Member) -> None:
    invite = mesh.invite(NOW, max_uses=0)
    member = admitted(state, owner, invite)
    mine = AdmissionState(mesh.mesh_id, mesh.public)  # the member's own view, as an admitter
    nodes = [admitted(mine, member, invite, quota_for=member.id) for _ in range(ADMISSIONS_PER_MEMBER)]
    extra = applicant(invite)
    with pytest.raises(AdmitterQuota):
        mine.admit(extra.id, extra.credential, NOW, quota_for=member.id)
    # Everyone else counts the same: its nodes past the quota are refused, and so are their own.
    for node in nodes:
        state.verify_member(node.id, node.credential, NOW)
    assert state.admitted_by(member.id) == ADMISSIONS_PER_MEMBER
    grant = make_grant(member.key, member.credential, mesh.mesh_id, extra.id, invite_id(invite), NOW)
    with pytest.raises(AdmitterQuota):
        state.verify_member(extra.id, with_grant(extra.credential, grant), NOW)
    grand = applicant(invite)
    grant = make_grant(nodes[0].key, nodes[0].credential, mesh.mesh_id, grand.id, invite_id(invite), NOW)
    with pytest.raises(AdmitterQuota):  # charged to every admitter up the chain
        state.verify_member(grand.id, with_grant(grand.credential, grant), NOW)
    state.forget(nodes[0].id)  # one left our table: its slot is free again
    state.verify_member(extra.id, with_grant(extra.credential, make_grant(
        member.key, member.credential, mesh.mesh_id, extra.id, invite_id(invite), NOW)), NOW)


def test_chains_are_bounded(mesh: MeshKey, state: AdmissionState, owner: Member) -> None:
    invite = mesh.invite(NOW, max_uses=0)
    admitter = owner
    for depth in range(1, CHAIN_MAX + 1):
        node = applicant(invite)
        grant = make_grant(admitter.key, admitter.credential, mesh.mesh_id, node.id, invite_id(invite), NOW)
        node.credential = with_grant(node.credential, grant)
        if depth < CHAIN_MAX:
            state.verify_member(node.id, node.credential, NOW)
        else:
            with pytest.raises(VerificationError, match="admissions from the owner"):
                state.verify_member(node.id, node.credential, NOW)
        admitter = node


def test_tampered_token_refused(mesh: MeshKey) -> None:
    invitation = mesh.invite(NOW, ttl_s=60)
    signed, inv = invitation.invite, inspect_token(encode_token(invitation))
    longer = Invite(inv.mesh_id, inv.mesh_pub, inv.invite_id, inv.issued, inv.expires + 86400 * 365,
                    inv.max_uses, inv.bootstrap, inv.joiner_key)
    tampered = Signed(signed.domain, signed.signer, msgspec.msgpack.encode(longer), signed.sig)
    with pytest.raises(BadSignature):
        inspect_token(encode_token(Invitation(tampered, invitation.seed)))


def test_forged_invite_signed_by_other_key_refused(mesh: MeshKey, state: AdmissionState) -> None:
    attacker = SigningKey.generate()
    inv = inspect_token(encode_token(mesh.invite(NOW)))
    forged = sign(attacker, "invite", inv)
    with pytest.raises(WrongSigner):
        inspect_token(encode_token(Invitation(forged)))


def test_wrong_domain_refused(mesh: MeshKey) -> None:
    inv = inspect_token(encode_token(mesh.invite(NOW)))
    as_revocation = sign(mesh.signing_key, "revocation", inv)
    with pytest.raises(WrongDomain):
        inspect_token(encode_token(Invitation(as_revocation)))


def test_proof_signed_by_another_node_refused(mesh: MeshKey, state: AdmissionState) -> None:
    invite = mesh.invite(NOW)
    node = applicant(invite)
    impostor = node_id(bytes(SigningKey.generate().verify_key))
    with pytest.raises(WrongSigner):
        state.admit(impostor, node.credential, NOW)
    assert state.uses(invite_id(invite)) == 0


@pytest.mark.parametrize("token", ["", "!!!", "a" * 20000, "bG9s", "ünicode"])
def test_garbage_tokens_are_decode_errors(token: str) -> None:
    with pytest.raises(DecodeError):
        decode_token(token)


def test_refusals_are_verification_or_decode_errors(mesh: MeshKey, state: AdmissionState) -> None:
    node = applicant(mesh.invite(NOW, ttl_s=1))
    with pytest.raises(VerificationError):
        state.admit(node.id, node.credential, NOW + 2)
    with pytest.raises(DecodeError):
        state.admit(node.id, b"\x00garbage", NOW)
    with pytest.raises(DecodeError):  # an old-style bare proof is no credential
        state.admit(node.id, decode_credential_proof(node.credential), NOW)
    with pytest.raises(DecodeError):
        decode_signed(b"")


def decode_credential_proof(credential: bytes) -> bytes:
    return msgspec.msgpack.decode(credential, type=Credential).proof


def test_credentials_round_trip(mesh: MeshKey) -> None:
    node = applicant(mesh.invite(NOW))
    cred = msgspec.msgpack.decode(node.credential, type=Credential)
    assert encode_credential(cred) == node.credential and cred.grant == b""


def test_a_signed_invite_without_its_token_admits_nobody(mesh: MeshKey, state: AdmissionState) -> None:
    """The signed invite any member reads in a credential is not the token: without the joiner key's
    seed a fresh key is refused first-hand, and a possession signature is good for its own node only."""
    invitation = mesh.invite(NOW, max_uses=0)
    reader = applicant(Invitation(invitation.invite))
    with pytest.raises(NotAdmitted, match="does not hold"):
        state.admit(reader.id, reader.credential, NOW)
    honest, thief = applicant(invitation), SigningKey.generate()
    stolen = decode_struct(decode_signed(decode_credential(honest.credential).proof).body, MembershipProof,
                           what="proof")
    thief_id = node_id(bytes(thief.verify_key))
    replayed = MembershipProof(stolen.mesh_id, thief_id, stolen.invite, NOW, stolen.possession)
    credential = encode_credential(Credential(encode_signed(sign(thief, "membership", replayed))))
    with pytest.raises(NotAdmitted, match="does not hold"):
        state.admit(thief_id, credential, NOW)
    assert state.admit(honest.id, honest.credential, NOW) is not None


def test_an_invite_from_before_joiner_keys_is_refused_first_hand(mesh: MeshKey, state: AdmissionState) -> None:
    inv = inspect_token(encode_token(mesh.invite(NOW)))
    old = Invite(inv.mesh_id, inv.mesh_pub, inv.invite_id, inv.issued, inv.expires, inv.max_uses, inv.bootstrap)
    node = applicant(Invitation(sign(mesh.signing_key, "invite", old)))
    with pytest.raises(NotAdmitted, match="older version"):
        state.admit(node.id, node.credential, NOW)
