"""Revocations in the gossip core (sans-IO): verified before use, flooded once, greeted to newcomers."""

from __future__ import annotations

import random

import pytest
from sim import MESH, check_trust, make_key, make_record
from sim import check_member as sim_check_member

from meshllm.errors import DecodeError, NodeRevoked, WrongSigner
from meshllm.identity.signing import encode_signed
from meshllm.mesh.admission import AdmissionState, MeshKey
from meshllm.mesh.gossip import Gossip, Rejected, RevocationApplied, Send
from meshllm.mesh.messages import (
    REVOCATIONS_PER_MESSAGE,
    Digest,
    Exchange,
    Revocations,
    Summary,
    decode_message,
    encode_message,
)
from meshllm.mesh.records import RecordVerifier, sign_record
from meshllm.mesh.view import PeerRemoved

A, B, C, D = make_key(20), make_key(21), make_key(22), make_key(23)
MESH_KEY = MeshKey(make_key(99))


def nid(key) -> str:
    return make_record(key).node_id


def member(key=A, mesh_key: MeshKey = MESH_KEY) -> tuple[Gossip, AdmissionState]:
    """A gossip core whose membership check also refuses what its admission state revoked."""
    admission = AdmissionState(mesh_key.mesh_id, mesh_key.public)

    def check_member(node: str, proof: bytes, now: float) -> None:
        sim_check_member(node, proof, now)
        if node in admission.revoked_nodes:
            raise NodeRevoked(f"node {node[:8]} was revoked by the mesh owner")

    verifier = RecordVerifier(MESH, check_member, check_trust)
    g = Gossip(key, make_record(key), verifier, random.Random(0), now=0.0,
               verify_revocation=admission.apply_revocation)
    return g, admission


def revocation(kind: str, target: str, mesh_key: MeshKey = MESH_KEY) -> bytes:
    return encode_signed(mesh_key.revoke(kind, target, 1.0))  # type: ignore[arg-type]


def test_a_new_revocation_is_applied_and_flooded_once() -> None:
    g, admission = member()
    for peer in (B, C, D):
        g.peer_connected(nid(peer))
        g.receive(nid(peer), Exchange([sign_record(peer, make_record(peer, seq=2))]), now=1.0)
    raw = revocation("node", nid(C))
    out = g.receive(nid(B), Revocations([raw]), now=2.0)
    assert RevocationApplied("node", nid(C), nid(B)) in out
    assert PeerRemoved(nid(C), "revoked") in out
    sends = [o for o in out if isinstance(o, Send)]
    assert {s.to for s in sends} == {nid(C), nid(D)}  # everyone connected but the sender
    assert all(s.message == Revocations([raw]) for s in sends)
    assert nid(C) in admission.revoked_nodes and nid(C) not in g.members()
    assert g.state.peers[nid(C)].status == "revoked"
    # Heard again (from anyone): nothing happens, nothing is sent.
    assert g.receive(nid(D), Revocations([raw]), now=3.0) == []
    # A newer record of the revoked node is refused, quietly (peers still hold it while the revocation spreads).
    assert g.receive(nid(D), Exchange([sign_record(C, make_record(C, seq=9))]), now=3.0) == []
    assert nid(C) not in g.members()
    # Its tombstone is never handed out, and a digest claiming a newer copy does not make us ask for it.
    (reply,) = g.receive(nid(D), Digest({nid(C): 50}), now=3.0)
    assert isinstance(reply.message, Exchange) and nid(C) not in reply.message.want
    assert sign_record(C, make_record(C, seq=2)) not in reply.message.records


def test_owner_revocation_is_flooded_to_every_connected_peer() -> None:
    g, _ = member()
    for peer in (B, C):
        g.peer_connected(nid(peer))
    raw = revocation("invite", "aaaaaaaaaaaaaaaa")
    out = g.add_revocation(raw, now=1.0)
    assert out[0] == RevocationApplied("invite", "aaaaaaaaaaaaaaaa", None)
    assert [o for o in out if isinstance(o, Send)] == [Send(p, Revocations([raw])) for p in sorted((nid(B), nid(C)))]
    assert g.add_revocation(raw, now=2.0) == []


@pytest.mark.parametrize("case", ["other mesh key", "node-signed", "garbage", "too large"])
def test_forged_revocations_are_rejected_and_change_nothing(case: str) -> None:
    g, admission = member()
    g.peer_connected(nid(B))
    g.peer_connected(nid(D))
    g.receive(nid(B), Exchange([sign_record(C, make_record(C, seq=2))]), now=1.0)
    if case == "other mesh key":
        raw = revocation("node", nid(C), MeshKey(make_key(98)))
    elif case == "node-signed":  # a member signing a "revocation" with its own key
        forger = MeshKey(B)
        raw = encode_signed(forger.revoke("node", nid(C), 1.0))
    elif case == "garbage":
        raw = b"\x94not a signed record"
    else:
        raw = b"\x00" * 2000
    good = revocation("invite", "bbbbbbbbbbbbbbbb")
    out = g.receive(nid(B), Revocations([raw, good]), now=2.0)
    assert len(out) == 1 and isinstance(out[0], Rejected) and out[0].source == nid(B)
    if case == "other mesh key":
        assert isinstance(out[0].error, WrongSigner)
    assert not g.revocations and not admission.revoked_nodes and not admission.revoked_invites
    assert nid(C) in g.members()


def test_revocations_are_refused_without_a_verifier() -> None:
    g = Gossip(A, make_record(A), RecordVerifier(MESH, sim_check_member, check_trust), random.Random(0), now=0.0)
    (out,) = g.receive(nid(B), Revocations([revocation("node", nid(C))]), now=1.0)
    assert isinstance(out, Rejected)


def test_greet_sends_known_revocations_to_a_new_peer() -> None:
    g, _ = member()
    assert [type(o.message) for o in g.greet(nid(B)) if isinstance(o, Send)] == [Summary]
    raws = [revocation("node", nid(C)), revocation("invite", "cccccccccccccccc")]
    for raw in raws:
        g.add_revocation(raw, now=1.0)
    greeting = g.greet(nid(D))
    assert Send(nid(D), Revocations(raws)) in greeting
    # A late joiner that hears them applies them.
    late, admission = member(D)
    for o in greeting:
        if isinstance(o, Send) and isinstance(o.message, Revocations):
            late.receive(nid(A), o.message, now=2.0)
    assert nid(C) in admission.revoked_nodes and "cccccccccccccccc" in admission.revoked_invites


def test_revocations_message_is_bounded_at_decode() -> None:
    raw = revocation("node", nid(C))
    assert decode_message(encode_message(Revocations([raw]))) == Revocations([raw])
    with pytest.raises(DecodeError):
        decode_message(encode_message(Revocations([raw] * (REVOCATIONS_PER_MESSAGE + 1))))
    with pytest.raises(DecodeError):
        decode_message(encode_message(Revocations([b"x" * 5000])))
