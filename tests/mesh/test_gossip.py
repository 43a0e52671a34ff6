"""Gossip: verification before storage, push-pull, convergence, refutation and graceful leave."""

from __future__ import annotations

import random

import msgspec
import pytest
from sim import SimNet, make_key, make_record, make_verifier

from meshllm.errors import BadSignature, InviteRevoked, WrongMesh, WrongSigner
from meshllm.identity.signing import sign
from meshllm.mesh import view
from meshllm.mesh.gossip import Gossip, Rejected, Send, UnknownReporter
from meshllm.mesh.messages import Digest, DownNotice, Exchange, Notices, sign_notice
from meshllm.mesh.records import Load, PeerRecord, RecordVerifier, sign_record

A, B, C = make_key(10), make_key(11), make_key(12)


def gossip_for(key=A, verifier: RecordVerifier | None = None) -> Gossip:
    return Gossip(key, make_record(key), verifier or make_verifier(), random.Random(0), now=0.0)


def test_push_pull_answers_what_the_other_side_lacks_and_asks_for_the_rest() -> None:
    a = gossip_for(A)
    c_raw = sign_record(C, make_record(C, seq=3))
    a.receive("peer", Exchange([c_raw]), now=1.0)
    b_id = make_record(B).node_id
    out = a.receive(b_id, Digest({b_id: 7, make_record(C).node_id: 1}), now=1.0)
    (reply,) = out
    assert isinstance(reply, Send) and isinstance(reply.message, Exchange)
    assert set(reply.message.records) == {a.own_raw, c_raw}
    assert reply.message.want == [b_id]
    answer = a.receive(b_id, Exchange([], want=[make_record(C).node_id]), now=1.0)
    assert answer == [Send(b_id, Exchange([c_raw]))]


def bad_records() -> list[tuple[bytes, type[Exception], RecordVerifier | None]]:
    good = make_record(B, seq=2)
    tampered = bytearray(sign_record(B, good))
    tampered[-1] ^= 1

    def refuse(node: str, proof: bytes, now: float) -> None:
        raise InviteRevoked("forged proof")

    return [
        (bytes(tampered), BadSignature, None),
        (msgspec.msgpack.encode(sign(C, "peer-record", good)), WrongSigner, None),
        (sign_record(B, msgspec.structs.replace(good, mesh_id="other")), WrongMesh, None),
        (sign_record(B, good), InviteRevoked, RecordVerifier("simmesh", refuse, lambda *a: None)),
        (b"\x93garbage", Exception, None),
    ]


@pytest.mark.parametrize(("raw", "error", "verifier"), bad_records())
def test_rejected_records_leave_state_unchanged(raw: bytes, error: type, verifier) -> None:
    g = gossip_for(A, verifier)
    before = g.state
    out = g.receive("sender", Exchange([raw]), now=1.0)
    assert g.state is before
    (rejected,) = out
    assert isinstance(rejected, Rejected) and isinstance(rejected.error, error)
    assert rejected.source == "sender"


def test_stale_records_are_dropped_silently() -> None:
    g = gossip_for(A)
    g.receive("x", Exchange([sign_record(B, make_record(B, seq=5))]), now=1.0)
    before = g.state
    assert g.receive("x", Exchange([sign_record(B, make_record(B, seq=4, name="old"))]), now=1.0) == []
    assert g.state is before


def test_notice_from_a_non_member_is_rejected() -> None:
    g = gossip_for(A)
    g.receive("x", Exchange([sign_record(B, make_record(B, seq=5))]), now=1.0)
    b_id, c_id = make_record(B).node_id, make_record(C).node_id
    raw = sign_notice(C, DownNotice(b_id, 5, c_id, 1.0))
    before = g.state
    (out,) = g.receive("x", Notices([raw]), now=1.0)
    assert isinstance(out, Rejected) and isinstance(out.error, UnknownReporter)
    assert g.state is before


def test_five_nodes_converge_from_a_single_bootstrap() -> None:
    net = SimNet(5, seed=3)
    net.run_until(5.0)
    for node in net.nodes.values():
        assert set(node.gossip.members()) == set(net.ids) - {node.id}
        assert not node.rejected
    changer = net.nodes[net.ids[4]]
    changer.gossip.update_own(net.now, load=Load(in_flight=2, queue=1, tok_s=30.0))
    start = net.now
    net.run_until(start + 3.0)
    for node in net.live():
        if node is not changer:
            assert node.gossip.members()[changer.id].load.in_flight == 2


def test_runs_are_deterministic_given_the_seed() -> None:
    runs = []
    for _ in range(2):
        net = SimNet(8, seed=5, loss=0.05)
        net.run_until(6.0)
        runs.append((net.messages, dict(net.bytes_sent)))
    assert runs[0] == runs[1]


def test_live_node_refutes_a_down_notice_about_itself() -> None:
    net = SimNet(5, seed=4)
    net.run_until(4.0)
    reporter, subject = net.ids[1], net.ids[2]
    seq_before = net.nodes[subject].gossip.own.seq
    net.act(reporter, net.nodes[reporter].gossip.declare_down(subject, net.now))
    assert subject not in net.nodes[reporter].gossip.members()
    net.run_until(net.now + 2.0)
    assert net.nodes[subject].gossip.own.seq > seq_before
    for node in net.live():
        if node.id != subject:
            assert subject in node.gossip.members(), node.id


def test_graceful_leave_reaches_every_peer_within_a_second() -> None:
    net = SimNet(20, seed=6, preseed=True)
    net.run_until(2.0)
    leaver = net.nodes[net.ids[7]]
    removed: dict[str, str] = {}
    net.observers.append(
        lambda node, ev: removed.setdefault(node.id, ev.reason)
        if isinstance(ev, view.PeerRemoved) and ev.node_id == leaver.id
        else None
    )
    start = net.now
    net.act(leaver.id, leaver.gossip.leave(start))
    assert leaver.gossip.own.state == "leaving"
    net.kill(leaver.id)  # it exits right after saying goodbye
    net.run_until(start + 1.0)
    others = {n.id for n in net.live()}
    assert set(removed) == others
    assert set(removed.values()) == {"left"}
    for node in net.live():
        assert node.gossip.state.peers[leaver.id].status == "left"


def test_newer_copy_of_ourselves_is_outranked() -> None:
    g = gossip_for(A)
    g.receive("x", Digest({g.node_id: 40}), now=1.0)
    assert g.own.seq == 41
    assert isinstance(g.own, PeerRecord)
