"""The peer table's pure updates, its diff events, and bounded partial views."""

from __future__ import annotations

import math
import random

from sim import SimNet, make_key, make_record, make_verifier

from meshllm.mesh import view
from meshllm.mesh.gossip import Gossip
from meshllm.mesh.messages import Exchange
from meshllm.mesh.records import Load, sign_record

B = make_key(21)
B_ID = make_record(B).node_id


def stored(seq: int, now: float, **fields) -> view.RecordStored:
    rec = make_record(B, seq=seq, **fields)
    return view.RecordStored(rec, sign_record(B, rec), now)


def test_apply_is_pure_and_diff_names_the_change() -> None:
    s0 = view.empty("me")
    s1 = view.apply(s0, stored(1, 1.0))
    assert s0.peers == {} and s1.peers[B_ID].status == "alive"
    assert view.diff(s0, s1) == [view.PeerAdded(B_ID, s1.peers[B_ID].record)]
    s2 = view.apply(s1, stored(2, 2.0, load=Load(queue=3)))
    assert view.diff(s1, s2) == [view.RecordUpdated(B_ID, s2.peers[B_ID].record)]
    s3 = view.apply(s2, view.MarkSuspect(B_ID, 3.0))
    assert view.diff(s2, s3) == [view.PeerStatus(B_ID, "suspect")]
    assert view.diff(s3, view.apply(s3, view.MarkAlive(B_ID, 3.5))) == [view.PeerStatus(B_ID, "alive")]
    s4 = view.apply(s3, view.MarkDown(B_ID, 2, b"notice", 4.0))
    assert view.diff(s3, s4) == [view.PeerRemoved(B_ID, "down")]
    assert view.held_seq(s4, B_ID) == 2  # tombstone keeps the staleness bar
    assert view.members(s4) == {}


def test_changed_dates_joining_and_leaving_not_suspicions() -> None:
    """``changed`` (``/api/status``'s ``changed_s``) moves when a peer joins or leaves our membership; alive
    and suspect are both members, and a newer record of a member is no change either."""
    s = view.apply(view.empty("me"), stored(1, 1.0))
    for update in [stored(2, 2.0, load=Load(queue=3)), view.MarkSuspect(B_ID, 3.0), view.MarkAlive(B_ID, 3.5),
                   view.MarkSuspect(B_ID, 3.7), stored(3, 3.8)]:
        s = view.apply(s, update)
        assert s.peers[B_ID].changed == 1.0
    s = view.apply(s, view.MarkDown(B_ID, 3, b"notice", 4.0))
    assert s.peers[B_ID].changed == 4.0
    s = view.apply(s, stored(4, 5.0))  # refuted: a member again
    assert (s.peers[B_ID].status, s.peers[B_ID].changed) == ("alive", 5.0)
    s = view.apply(s, stored(5, 6.0, state="leaving"))
    assert (s.peers[B_ID].status, s.peers[B_ID].changed) == ("left", 6.0)


def test_down_notice_older_than_the_record_is_ignored() -> None:
    s = view.apply(view.empty("me"), stored(5, 1.0))
    assert view.apply(s, view.MarkDown(B_ID, 4, b"n", 2.0)) is s


def test_leaving_record_means_left() -> None:
    s1 = view.apply(view.empty("me"), stored(1, 1.0))
    s2 = view.apply(s1, stored(2, 2.0, state="leaving"))
    assert view.diff(s1, s2) == [view.PeerRemoved(B_ID, "left")]


def test_expire_downs_silent_peers_and_forgets_tombstones() -> None:
    s = view.apply(view.empty("me"), stored(1, 0.0))
    assert view.apply(s, view.Expire(10.0, 120.0, 300.0)) is s
    down = view.apply(s, view.Expire(121.0, 120.0, 300.0))
    assert down.peers[B_ID].status == "down"
    assert view.apply(down, view.Expire(500.0, 120.0, 300.0)).peers == {}


def test_ourselves_never_enter_the_table() -> None:
    s = view.empty(B_ID)
    assert view.apply(s, stored(1, 0.0)) is s


def test_partial_view_is_bounded_and_rotates() -> None:
    rng = random.Random(3)
    pool = [f"n{i:03}" for i in range(500)]
    size = view.view_size(500)
    assert size == math.ceil(math.log2(501)) + 3
    def refresh(current: frozenset[str], candidates: list[str], rotate: bool) -> frozenset[str]:
        return view.refresh_partial_view(current, set(candidates).__contains__,
                                         view.draw_from(candidates, rng), size, rng, rotate)

    v = refresh(frozenset(), pool, rotate=False)
    assert len(v) == size and v <= set(pool)
    assert refresh(v, pool, rotate=False) == v
    rotated = refresh(v, pool, rotate=True)
    assert len(rotated) == size and len(rotated & v) >= size - 1
    assert refresh(v, pool[:3], rotate=False) <= set(pool[:3])


def test_table_samples_uniformly_without_listing() -> None:
    rng = random.Random(5)
    record = make_record(make_key(1))
    entry = view.PeerEntry(record, b"", "alive", 0.0, 0.0)
    letters = zip("abcdefgh" * 25, "ab2" * 67, "z7" * 100, strict=False)
    ids = [f"{c1}{c2}{c3}{i}" for i, (c1, c2, c3) in enumerate(letters)]
    table = view.Table.of({n: entry for n in ids})
    counts = dict.fromkeys(ids, 0)
    for _ in range(2000):
        (pick,) = table.sample(rng, 1, lambda n, e: True)
        counts[pick] += 1
    assert min(counts.values()) > 0 and max(counts.values()) < 40  # mean 10 per id
    assert sorted(table.sample(rng, len(ids) + 5, lambda n, e: True)) == sorted(ids)
    assert table.sample(rng, 3, lambda n, e: n == ids[7]) == [ids[7]]


def test_desired_connections_keep_pinned_peers_and_a_bounded_random_view() -> None:
    key = make_key(30)
    g = Gossip(key, make_record(key), make_verifier(), random.Random(1), now=0.0)
    others = [make_key(100 + i) for i in range(64)]
    g.receive("x", Exchange([sign_record(k, make_record(k)) for k in others]), now=0.0)
    pinned = make_record(others[0]).node_id
    g.pinned.add(pinned)
    desired = g.desired_connections(1.0)
    assert pinned in desired
    assert len(desired) <= view.view_size(65) + 1


def test_large_mesh_keeps_connections_bounded_and_still_converges() -> None:
    n = 100
    net = SimNet(n, seed=2, preseed=True)
    net.run_until(2.0)
    bound = view.view_size(n)
    for node in net.nodes.values():
        assert len(node.desired) <= bound
    mean = sum(len(node.gossip.connected) for node in net.nodes.values()) / n
    assert mean <= 2.5 * bound
    changer = net.nodes[net.ids[0]].gossip
    changer.update_own(net.now, load=Load(in_flight=9))
    start, interval = net.now, changer.interval()
    net.run_until(start + 8 * interval)  # O(log N) rounds
    for node in net.nodes.values():
        if node.id != changer.node_id:
            assert node.gossip.state.peers[changer.node_id].record.load.in_flight == 9


def test_silence_counts_from_the_signature_of_a_replayed_record() -> None:
    """A record arriving long after it was signed is as old as its signature, not as its arrival."""
    state = view.apply(view.empty("me"), stored(1, 500.0, signed_at=400.0))
    assert view.members(view.apply(state, view.Expire(525.0, stale_after=120.0, forget_after=300.0))) == {}
    fresh = view.apply(view.empty("me"), stored(1, 500.0, signed_at=500.0))
    assert B_ID in view.members(view.apply(fresh, view.Expire(525.0, stale_after=120.0, forget_after=300.0)))


def test_a_notice_naming_a_later_sequence_than_ours_changes_nothing() -> None:
    state = view.apply(view.empty("me"), stored(5, 1.0))
    assert view.apply(state, view.MarkDown(B_ID, 6, b"notice", 2.0)) is state
    assert view.apply(state, view.MarkDown(B_ID, 2**62 - 1, b"notice", 2.0)) is state
