"""Gossip: verification before storage, push-pull, convergence, refutation and graceful leave."""

from __future__ import annotations

import random

import msgspec
import pytest
from sim import SimNet, make_key, make_record, make_verifier

from meshllm.errors import BadSignature, InviteRevoked, WrongMesh, WrongSigner
from meshllm.identity.signing import sign
from meshllm.mesh import view
from meshllm.mesh.failure import Overstep
from meshllm.mesh.gossip import ANSWER_WAIT_S, ITEMS_MAX, ITEMS_SLACK, REFINE_AT, Gossip, Rejected, Send
from meshllm.mesh.messages import Digest, DownNotice, Exchange, Notices, Summary, sign_notice
from meshllm.mesh.records import (
    SEQ_LIMIT,
    Load,
    PeerRecord,
    RecordVerifier,
    RttEntry,
    SequenceOutOfRange,
    decode_record,
    sign_record,
)

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
    rejected, *rest = out
    assert isinstance(rejected, Rejected) and isinstance(rejected.error, error)
    assert rejected.source == "sender"
    # Forgery (bad signature, wrong signer, garbage) is counted against the peer that forwarded it;
    # a genuine record that our own checks refuse is not (honest peers may disagree on membership).
    forged = error in (BadSignature, WrongSigner, Exception)
    assert rest == ([Overstep("sender", rest[0].reason)] if forged else [])


def test_stale_records_are_dropped_silently() -> None:
    g = gossip_for(A)
    g.receive("x", Exchange([sign_record(B, make_record(B, seq=5))]), now=1.0)
    before = g.state
    assert g.receive("x", Exchange([sign_record(B, make_record(B, seq=4, name="old"))]), now=1.0) == []
    assert g.state is before


def test_a_notice_from_a_non_member_counts_for_nothing_and_the_rest_are_read() -> None:
    g = gossip_for(A)
    g.receive("x", Exchange([sign_record(k, make_record(k, seq=5)) for k in (B, C)]), now=1.0)
    before = g.state
    b_id, c_id, outsider = make_record(B).node_id, make_record(C).node_id, make_key(13)
    stranger = sign_notice(outsider, DownNotice(b_id, 5, make_record(outsider).node_id, 1.0))
    assert g.receive("x", Notices([stranger]), now=1.0) == [] and g.state is before  # (no strike, no log)
    member = sign_notice(C, DownNotice(b_id, 5, c_id, 1.0))
    g.receive("x", Notices([stranger, member]), now=1.0)  # routine while membership spreads: read on
    assert g.state.peers[b_id].status == "down"


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
    raw_before = g.own_raw
    # A digest's claim is unsigned: we ask for the copy instead of re-signing on the claim.
    (reply,) = g.receive("x", Digest({g.node_id: 40}), now=1.0)
    assert g.own.seq == 1 and g.own_raw == raw_before
    assert reply == Send("x", Exchange([], want=[g.node_id]))
    # The signed copy comes back and is outranked.
    assert g.receive("x", Exchange([sign_record(A, make_record(A, seq=40))]), now=1.0) == []
    assert g.own.seq == 41


def test_digest_claim_at_uint64_max_cannot_lock_us_out() -> None:
    g = gossip_for(A)
    own, raw = g.own, g.own_raw
    (reply,) = g.receive("x", Digest({g.node_id: 2**64 - 1}), now=1.0)
    assert g.own is own and g.own_raw == raw
    assert reply.message.want == [g.node_id]
    g.update_own(2.0, load=Load(in_flight=1))  # still able to re-sign
    assert g.own.seq == 2 and decode_record(g.own_raw)[1] == g.own


def test_failed_resign_leaves_our_record_unchanged() -> None:
    g = Gossip(A, make_record(A, seq=SEQ_LIMIT - 1), make_verifier(), random.Random(0), now=0.0)
    own, raw, due = g.own, g.own_raw, g.next_timer()
    with pytest.raises(SequenceOutOfRange):
        g.update_own(1.0, load=Load(in_flight=1))
    assert g.own is own and g.own_raw == raw and g.next_timer() == due


def member_gossip() -> tuple[Gossip, str]:
    """A gossip of A that holds B as a live member (a valid down-notice reporter)."""
    g = gossip_for(A)
    g.receive("x", Exchange([sign_record(B, make_record(B, seq=5))]), now=1.0)
    g.peer_connected("x")
    return g, make_record(B).node_id


def test_notice_about_us_above_our_seq_is_ignored() -> None:
    g, b_id = member_gossip()
    own = g.own
    raw = sign_notice(B, DownNotice(g.node_id, own.seq + 1000, b_id, 1.0))
    assert g.receive("x", Notices([raw]), now=2.0) == []
    assert g.own is own


def test_notice_about_our_current_seq_is_refuted() -> None:
    g, b_id = member_gossip()
    seq = g.own.seq
    out = g.receive("x", Notices([sign_notice(B, DownNotice(g.node_id, seq, b_id, 1.0))]), now=2.0)
    assert g.own.seq == seq + 1
    assert out == [Send("x", Exchange([g.own_raw]))]
    # An older notice needs no new sequence: our current record already outranks it.
    g.receive("x", Notices([sign_notice(B, DownNotice(g.node_id, seq, b_id, 1.5))]), now=3.0)
    assert g.own.seq == seq + 1


def test_want_is_deduplicated_and_limited_to_what_we_hold() -> None:
    g = gossip_for(A)
    c_raw = sign_record(C, make_record(C, seq=3))
    g.receive("x", Exchange([c_raw]), now=1.0)
    c_id = make_record(C).node_id
    want = [c_id] * 5000 + [f"unknown{i}" for i in range(5000)] + [g.node_id] * 5000
    (reply,) = g.receive("y", Exchange([], want=want), now=1.0)
    assert reply == Send("y", Exchange([c_raw, g.own_raw]))
    assert g.receive("y", Exchange([], want=["nobody", "else"]), now=1.0) == []


def test_records_per_exchange_are_capped() -> None:
    g = gossip_for(A)
    raws = [sign_record(make_key(100 + i), make_record(make_key(100 + i), seq=1)) for i in range(40)]
    g.receive("x", Exchange(raws), now=1.0)
    assert len(g.members()) == ITEMS_SLACK  # held 0: at most 0 + 16 verified
    g.receive("x", Exchange(raws[ITEMS_SLACK:]), now=1.0)
    assert len(g.members()) == 40  # held 16: up to 32 verified, all 24 new ones fit
    assert g._items_cap() == 40 + ITEMS_SLACK
    entry = next(iter(g.state.peers.values()))
    g.adopt(view.ViewState(g.node_id, {f"n{i}": entry for i in range(1000)}), first_deadline=0.0)
    assert g._items_cap() == ITEMS_MAX  # a big table still verifies at most 256 per message


def test_a_joining_node_takes_the_whole_answer_to_its_want_list() -> None:
    """The cap grows by what we asked the sender for: a node holding nothing learns a mesh of 40 from one
    exchange, not 16 from the first and the rest rounds later; a sender we asked nothing gets the plain cap."""
    keys = [make_key(100 + i) for i in range(40)]
    raws = [sign_record(k, make_record(k, seq=1)) for k in keys]
    g = gossip_for(A)
    out = g.receive("x", Digest({make_record(k).node_id: 1 for k in keys}), now=1.0)
    (ask,) = [o.message for o in out if isinstance(o, Send) and isinstance(o.message, Exchange)]
    assert len(ask.want) == 40
    g.receive("y", Exchange(raws), now=1.0)  # y was asked nothing
    assert len(g.members()) == ITEMS_SLACK
    g = gossip_for(A)
    g.receive("x", Digest({make_record(k).node_id: 1 for k in keys}), now=1.0)
    g.receive("x", Exchange(raws), now=1.0)
    assert len(g.members()) == 40
    assert g._items_cap() == 40 + ITEMS_SLACK  # the credit was spent on that answer
    # a push from the same peer that comes before the answer spends only what it carried
    g = gossip_for(A)
    g.receive("x", Digest({make_record(k).node_id: 1 for k in keys}), now=1.0)
    g.receive("x", Exchange(raws[:1]), now=1.1)
    assert not g.answered  # one record of the 40 asked: not the answer
    g.receive("x", Exchange(raws), now=1.2)
    assert len(g.members()) == 40 and g.answered
    # an answer later than ANSWER_WAIT_S gets the plain cap
    g = gossip_for(A)
    g.receive("x", Digest({make_record(k).node_id: 1 for k in keys}), now=1.0)
    g.receive("x", Exchange(raws), now=1.0 + ANSWER_WAIT_S + 0.1)
    assert len(g.members()) == ITEMS_SLACK and not g.answered


def test_records_on_their_way_are_not_asked_for_again() -> None:
    """A starting member on a loaded host took 9 s to receive its first answer (200 KB), and asked again for
    the same records at every round meanwhile. A digest, from any peer, now asks only for what is not on
    its way: not before ANSWER_WAIT_S, unless the peer asked left or claims a newer copy."""
    keys = [make_key(100 + i) for i in range(40)]
    ids = [make_record(k).node_id for k in keys]
    g = gossip_for(A)

    def asked(source: str, digest: dict[str, int], now: float) -> list[str]:
        out = g.receive(source, Digest(digest), now=now)
        return [n for o in out if isinstance(o, Send) and isinstance(o.message, Exchange) for n in o.message.want]

    assert len(asked("x", dict.fromkeys(ids, 1), 1.0)) == 40
    assert asked("x", dict.fromkeys(ids, 1), 2.0) == [] and asked("y", dict.fromkeys(ids, 1), 3.0) == []
    assert not g.answered  # nothing held yet: still waiting, not "holding all it listed"
    assert asked("y", {ids[0]: 2, ids[1]: 1}, 3.0) == [ids[0]]  # a newer copy than the one asked for
    g.receive("x", Exchange([sign_record(k, make_record(k, seq=1)) for k in keys[:10]]), now=4.0)  # part of it
    assert len(g.members()) == 10
    g.peer_disconnected("x")  # the rest of x's answer will not come
    assert len(asked("y", dict.fromkeys(ids, 1), 5.0)) == 30
    assert asked("z", dict.fromkeys(ids, 1), 6.0) == []
    assert len(asked("z", dict.fromkeys(ids, 1), 5.0 + ANSWER_WAIT_S + 0.1)) == 30  # y's answer is overdue


def test_a_joiner_learns_a_mesh_past_the_refining_size_from_its_greeting() -> None:
    """A member holding more than REFINE_AT records per bucket answers a joiner's greeting with finer sums,
    the joiner answers those with a digest, and the member gives everything it lacks: the joiner takes it
    all a message may carry (not the plain cap of 16) and counts as answered."""
    size = REFINE_AT * 16 + 24
    keys = [make_key(1000 + i) for i in range(size)]
    member = gossip_for(A)
    for i in range(0, size, 200):  # a member learns them a message at a time, each message capped
        chunk = keys[i:i + 200]
        member.receive("x", Digest({make_record(k).node_id: 1 for k in chunk}), now=1.0)
        member.receive("x", Exchange([sign_record(k, make_record(k, seq=1)) for k in chunk]), now=1.0)
    assert len(member.members()) == size
    joiner = gossip_for(B)
    nodes = {"m": member, "j": joiner}
    member.peer_connected("j")
    joiner.peer_connected("m")
    queue = [("m", "j", o.message) for o in joiner.greet("m") if isinstance(o, Send)]
    kinds = []
    while queue:
        to, source, message = queue.pop(0)
        kinds.append(type(message).__name__)
        queue += [(o.to, to, o.message) for o in nodes[to].receive(source, message, now=2.0) if isinstance(o, Send)]
    assert kinds[:3] == ["Summary", "Summary", "Digest"]  # refined once, then the joiner's digest
    # all a message may carry (the plain cap was 16), and the rest at the next round
    assert len(joiner.members()) == ITEMS_MAX and joiner.answered
    assert joiner.node_id in member.members()  # and the member took the joiner's record from the same exchange


def test_first_rejected_record_stops_the_message() -> None:
    g = gossip_for(A)
    good_b = sign_record(B, make_record(B, seq=2))
    good_c = sign_record(C, make_record(C, seq=2))
    bad = bytearray(sign_record(make_key(99), make_record(make_key(99), seq=2)))
    bad[-1] ^= 1
    out = g.receive("x", Exchange([good_b, bytes(bad), bytes(bad), good_c]), now=1.0)
    rejected = [o for o in out if isinstance(o, Rejected)]
    assert len(rejected) == 1 and isinstance(rejected[0].error, BadSignature)
    assert out[-2] is rejected[0] and isinstance(out[-1], Overstep)  # the forwarder gets a strike
    assert any(isinstance(o, view.PeerAdded) for o in out)  # events before the bad record are kept
    assert set(g.members()) == {make_record(B).node_id}  # nothing after it was processed
    assert isinstance(g.own, PeerRecord)


def test_a_refresh_goes_to_a_few_peers_a_change_to_every_connected_peer() -> None:
    g = gossip_for(A)
    for i in range(6):
        g.peer_connected(f"p{i}")
    g.tick(0.0)  # the first round and our start-up record
    refresh_at = g.next_timer()
    while g.next_timer() < g.own.signed_at + g.config.refresh:
        g.tick(g.next_timer())
        refresh_at = g.next_timer()
    seq = g.own.seq
    out = g.tick(refresh_at)
    pushed = [o for o in out if isinstance(o, Send) and isinstance(o.message, Exchange)]
    assert g.own.seq == seq + 1 and g.own.signed_at == refresh_at
    assert len(pushed) == g.config.push_fanout and all(o.message.records == [g.own_raw] for o in pushed)
    g.update_own(refresh_at + 1.0, load=Load(in_flight=1))
    out = g.tick(refresh_at + 1.0)
    flooded = {o.to for o in out if isinstance(o, Send) and isinstance(o.message, Exchange)}
    assert flooded == {f"p{i}" for i in range(6)}


def test_a_peers_change_is_pushed_on_and_its_refresh_is_left_to_anti_entropy() -> None:
    """A stored record that changed goes on to ``push_fanout`` peers; the same record re-signed does not
    (anti-entropy spreads it), nor one whose RTT row moved only within the band its signer ignores."""
    g = gossip_for(A)
    for i in range(6):
        g.peer_connected(f"p{i}")
    b = make_record(B, seq=1, signed_at=1.0)
    g.receive("p0", Exchange([sign_record(B, b)]), now=1.0)

    def pushed(record: PeerRecord, now: float) -> set[str]:
        out = g.receive("p0", Exchange([sign_record(B, record)]), now=now)
        assert any(isinstance(o, view.RecordUpdated) for o in out)  # stored either way
        return {o.to for o in out if isinstance(o, Send) and isinstance(o.message, Exchange)}

    changed = msgspec.structs.replace(b, seq=2, signed_at=2.0, load=Load(in_flight=1))
    assert len(pushed(changed, 2.0)) == g.config.push_fanout
    refreshed = msgspec.structs.replace(changed, seq=3, signed_at=3.0, refresh=60.0)
    assert pushed(refreshed, 3.0) == set()
    row = {make_record(C).node_id: RttEntry(10.0, "direct")}
    with_row = msgspec.structs.replace(refreshed, seq=4, signed_at=4.0, rtt=row)
    assert len(pushed(with_row, 4.0)) == g.config.push_fanout  # a new peer in a short row is news
    jitter = {n: RttEntry(e.rtt_ms * 1.05, e.path) for n, e in row.items()}
    assert pushed(msgspec.structs.replace(with_row, seq=5, signed_at=5.0, rtt=jitter), 5.0) == set()


def test_a_node_whose_loop_runs_late_runs_its_rounds_less_often() -> None:
    """``tick``'s ``stretch`` (1 + the detector's local health) spaces anti-entropy rounds; changes still go
    out at once."""
    def rounds(stretch: int, until: float) -> list[float]:
        g = gossip_for(A)
        for i in range(4):
            g.peer_connected(f"p{i}")
        at: list[float] = []
        now = 0.0
        while now < until:
            if any(isinstance(o, Send) and isinstance(o.message, Summary) for o in g.tick(now, stretch)):
                at.append(now)
            now = max(now + 1e-3, g.next_timer())
        return at

    assert len(rounds(1, 12.0)) == 12 and len(rounds(3, 12.0)) == 4
    g = gossip_for(A)
    g.peer_connected("p0")
    g.tick(0.0, 3)
    g.update_own(0.5, load=Load(in_flight=1))
    assert g.next_timer() == 0.5
    assert any(isinstance(o, Send) and isinstance(o.message, Exchange) for o in g.tick(0.5, 3))


def test_refresh_period_stretches_so_the_mesh_refreshes_at_a_bounded_rate() -> None:
    cfg = Gossip(A, make_record(A), make_verifier(), random.Random(0), now=0.0).config
    assert cfg.refresh_for(10) == cfg.refresh
    assert cfg.refresh_for(4_000) == 4_000 / cfg.refresh_rate
    assert cfg.refresh_for(10**7) == 3600.0


def test_we_probe_the_peers_we_chose_not_every_connection() -> None:
    g = gossip_for(A)
    assert g.watched() == set()
    g.peer_connected("joining-through")
    assert g.watched() == {"joining-through"}  # knowing nobody yet: every connection is watched
    peers = [make_key(100 + i) for i in range(8)]
    g.receive("x", Exchange([sign_record(k, make_record(k, seq=2)) for k in peers]), now=1.0)
    chosen = g.desired_connections(1.0)
    for node in chosen:
        g.peer_connected(node)
    stranger = make_record(make_key(200)).node_id
    g.peer_connected(stranger)  # dialled us for its own partial view
    assert g.watched() == chosen and stranger not in g.watched()


def test_a_record_signed_before_its_nodes_death_cannot_revive_it() -> None:
    g = gossip_for(A)
    g.receive("x", Exchange([sign_record(B, make_record(B, seq=5, signed_at=100.0))]), now=100.0)
    g.receive("x", Exchange([sign_record(C, make_record(C, seq=5, signed_at=100.0))]), now=100.0)
    b_id = make_record(B).node_id
    notice = sign_notice(C, DownNotice(b_id, 5, make_record(C).node_id, 300.0))
    g.receive("x", Notices([notice]), now=300.0)
    assert b_id not in g.members()
    # A version B signed before it died (seq 6, 200 s before the notice), replayed: refused silently.
    early = sign_record(B, make_record(B, seq=6, signed_at=100.0))
    assert g.receive("y", Exchange([early]), now=301.0) == []
    assert b_id not in g.members()
    # B itself, back and re-signing after the notice: welcome.
    late = sign_record(B, make_record(B, seq=7, signed_at=302.0))
    g.receive("y", Exchange([late]), now=302.0)
    assert b_id in g.members()
