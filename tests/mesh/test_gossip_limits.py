"""Gossip against a hostile member (sans-IO): notices that cannot be weaponised, bounded answers."""

from __future__ import annotations

import random

import pytest
from sim import check_trust, make_key, make_record, make_verifier

from meshllm.errors import DecodeError, InviteRevoked
from meshllm.mesh.failure import Overstep
from meshllm.mesh.gossip import (
    ACCUSER_BAN_S,
    NOTICE_BURST,
    PULL_BURST,
    REFUTED_TO_BAN,
    WANT_MAX,
    AccuserBanned,
    Gossip,
    Rejected,
    Send,
)
from meshllm.mesh.messages import (
    IDS_MAX,
    Digest,
    DownNotice,
    Exchange,
    Notices,
    decode_message,
    encode_message,
    sign_notice,
)
from meshllm.mesh.records import SEQ_LIMIT, RecordVerifier, sign_record
from meshllm.mesh.view import PeerRemoved

A, B, C, D = make_key(30), make_key(31), make_key(32), make_key(33)
NOW = 1000.0


def nid(key) -> str:  # type: ignore[no-untyped-def]
    return make_record(key).node_id


def record(key, seq: int, at: float = NOW) -> bytes:  # type: ignore[no-untyped-def]
    return sign_record(key, make_record(key, seq=seq, signed_at=at))


def mesh(verifier: RecordVerifier | None = None) -> Gossip:
    """A's gossip holding B, C and D alive at seq 5; connected to C only."""
    g = Gossip(A, make_record(A), verifier or make_verifier(), random.Random(0), now=NOW)
    g.receive(nid(C), Exchange([record(B, 5), record(C, 5), record(D, 5)]), now=NOW)
    g.peer_connected(nid(C))
    return g


def notice(subject, seq: int, reporter=C, ts: float = NOW) -> bytes:  # type: ignore[no-untyped-def]
    return sign_notice(reporter, DownNotice(nid(subject), seq, nid(reporter), ts))


def status(g: Gossip, key) -> str:  # type: ignore[no-untyped-def]
    return g.state.peers[nid(key)].status


def test_a_notice_counts_only_for_the_sequence_we_hold() -> None:
    g = mesh()
    for seq in (SEQ_LIMIT - 1, 6, 4):  # beyond anything the subject can outrank, newer, older
        assert g.receive(nid(C), Notices([notice(B, seq)]), NOW) == []
        assert status(g, B) == "alive"
    g.receive(nid(C), Notices([notice(B, 5)]), NOW)
    assert status(g, B) == "down"
    g.receive(nid(C), Exchange([record(B, 6, NOW + 1)]), NOW + 1)  # B speaks again: one higher is enough
    assert status(g, B) == "alive"


def test_expired_and_future_notices_are_ignored() -> None:
    g = mesh()
    for ts in (NOW - 121, NOW + 61):
        assert g.receive(nid(C), Notices([notice(B, 5, ts=ts)]), NOW) == []
        assert status(g, B) == "alive"


def watch(g: Gossip, key) -> None:  # type: ignore[no-untyped-def]
    """Connect ``g`` to ``key``'s node as a peer it chose (pinned), so its detector probes it."""
    g.peer_connected(nid(key))
    g.pinned.add(nid(key))


def test_no_notice_outweighs_our_own_probes_of_the_subject() -> None:
    g = mesh()
    watch(g, B)
    assert nid(B) in g.watched()
    assert g.receive(nid(C), Notices([notice(B, 5)]), NOW) == []  # not applied, not spread
    assert status(g, B) == "alive"
    g.peer_disconnected(nid(B))
    out = g.receive(nid(C), Notices([notice(B, 5)]), NOW)
    assert status(g, B) == "down" and PeerRemoved(nid(B), "down") in out  # now it counts


def test_a_connection_we_do_not_probe_does_not_refute_a_notice() -> None:
    """B dialled us for its own partial view: its probers, not we, know whether it lives."""
    g = mesh()
    g.peer_connected(nid(B))
    assert nid(B) not in g.watched()
    out = g.receive(nid(C), Notices([notice(B, 5)]), NOW)
    assert status(g, B) == "down" and PeerRemoved(nid(B), "down") in out


def test_an_accuser_refuted_too_often_may_not_accuse_for_a_while() -> None:
    g = mesh()
    watch(g, B)
    outs = [g.receive(nid(C), Notices([notice(B, 5, ts=NOW + i * 0.1)]), NOW + i) for i in range(REFUTED_TO_BAN)]
    assert outs[-1] == [AccuserBanned(nid(C))]
    # Banned: even a notice that would otherwise count (about D, to which we have no connection) is ignored.
    assert g.receive(nid(C), Notices([notice(D, 5, ts=NOW + 5)]), NOW + 5) == []
    assert status(g, D) == "alive"
    later = NOW + ACCUSER_BAN_S + 10
    g.receive(nid(C), Exchange([record(C, 6, later), record(D, 6, later)]), later)
    g.receive(nid(C), Notices([notice(D, 6, ts=later)]), later)
    assert status(g, D) == "down"  # the ban ran out


def test_a_subject_that_comes_back_refutes_its_accuser() -> None:
    g = mesh()
    for i in range(REFUTED_TO_BAN):
        seq = 5 + i
        t = NOW + 10 * i
        out = g.receive(nid(C), Notices([notice(B, seq, ts=t)]), t)
        assert status(g, B) == "down"
        out = g.receive(nid(D), Exchange([record(B, seq + 1, t + 1)]), t + 1)  # B was alive after all
        assert status(g, B) == "alive"
    assert AccuserBanned(nid(C)) in out


def test_notices_are_rate_limited_per_accuser() -> None:
    g = mesh()
    raws = [sign_notice(C, DownNotice(nid(make_key(100 + i)), 1, nid(C), NOW)) for i in range(40)]
    outs = [g.receive(nid(C), Notices([raw]), NOW) for raw in raws]
    assert all(o == [] for o in outs[: int(NOTICE_BURST)])  # unknown subjects: accepted, nothing to do
    assert all(isinstance(o[0], Overstep) for o in outs[int(NOTICE_BURST):])


def test_a_notice_we_already_hold_costs_its_accuser_nothing() -> None:
    """Anti-entropy resends a down notice to every peer whose digest still lists the dead node: the
    honest accuser of one dead node must not overstep the notice rate by that."""
    g = mesh()
    raw = notice(B, 5)
    assert status(g, B) == "alive"
    g.receive(nid(C), Notices([raw]), NOW)
    assert status(g, B) == "down"
    outs = [g.receive(nid(C), Notices([raw]), NOW + i * 0.01) for i in range(4 * int(NOTICE_BURST))]
    assert all(o == [] for o in outs) and status(g, B) == "down"
    fresh = [sign_notice(C, DownNotice(nid(make_key(200 + i)), 1, nid(C), NOW)) for i in range(int(NOTICE_BURST))]
    assert all(g.receive(nid(C), Notices([r]), NOW + 0.5) == [] for r in fresh[:-1])  # its rate is intact


def test_digests_are_answered_at_a_bounded_rate() -> None:
    g = mesh()
    outs = [g.receive(nid(C), Digest({}), NOW) for _ in range(20)]
    answered = [o for o in outs if o and isinstance(o[0], Send)]
    assert len(answered) == int(PULL_BURST)
    assert all(o == [Overstep(nid(C), o[0].reason)] for o in outs[int(PULL_BURST):])
    assert g.receive(nid(C), Digest({}), NOW + 1.0)  # refilled


def test_a_digest_of_fake_ids_costs_one_bounded_want_list() -> None:
    g = mesh()
    fakes = {nid(make_key(1000 + i)): 7 for i in range(WANT_MAX * 3)}
    (reply,) = [o for o in g.receive(nid(C), Digest(fakes), NOW) if isinstance(o, Send)]
    assert isinstance(reply.message, Exchange) and len(reply.message.want) == WANT_MAX


def test_a_refused_record_is_reported_once_and_not_asked_for_again() -> None:
    e = make_key(34)

    def refuse_e(node: str, proof: bytes, now: float) -> None:
        if node == nid(e):
            raise InviteRevoked("no")

    g = mesh(RecordVerifier("simmesh", refuse_e, check_trust))
    (rejected,) = g.receive(nid(C), Exchange([record(e, 9)]), NOW)
    assert isinstance(rejected, Rejected)
    assert g.receive(nid(C), Exchange([record(e, 10)]), NOW + 1) == []  # quiet from then on
    (reply,) = g.receive(nid(C), Digest({nid(e): 11}), NOW + 2)
    assert nid(e) not in reply.message.want  # type: ignore[union-attr]


def test_digests_and_want_lists_naming_too_many_ids_do_not_decode() -> None:
    fakes = {f"id{i}": 1 for i in range(IDS_MAX + 1)}
    with pytest.raises(DecodeError):
        decode_message(encode_message(Digest(fakes)))
    with pytest.raises(DecodeError):
        decode_message(encode_message(Exchange([], want=list(fakes))))
    assert decode_message(encode_message(Digest(dict(list(fakes.items())[:IDS_MAX]))))


def test_record_updates_per_node_are_rate_limited_and_its_signer_struck() -> None:
    from meshllm.mesh.gossip import RECORD_UPDATE_BURST, RECORD_UPDATES_PER_S

    g = mesh()
    out: list = []
    for seq in range(6, 6 + int(RECORD_UPDATE_BURST) + 3):  # C re-signs its own record, all at once
        out += g.receive(nid(C), Exchange([record(C, seq)]), now=NOW + 0.001 * seq)
    struck = [o for o in out if isinstance(o, Overstep)]
    assert struck and struck[0].peer == nid(C)
    held = g.state.peers[nid(C)].record.seq
    assert held < 6 + RECORD_UPDATE_BURST + 2  # the ones over the rate were dropped, not stored
    later = NOW + 1 + 1 / RECORD_UPDATES_PER_S
    assert not [o for o in g.receive(nid(C), Exchange([record(C, 100, later)]), now=later) if isinstance(o, Overstep)]
    assert g.state.peers[nid(C)].record.seq == 100  # after a pause, updates are accepted again
    # relayed by another peer (C passing on B's over-rate records): dropped, but nobody struck
    for seq in range(6, 6 + int(RECORD_UPDATE_BURST) + 3):
        assert not [o for o in g.receive(nid(C), Exchange([record(B, seq)]), now=NOW) if isinstance(o, Overstep)]
