"""RTT rows, republishing on significant change, and the mesh-wide matrix."""

from __future__ import annotations

import random

from sim import SimNet, make_key, make_record, make_verifier

from meshllm.mesh import rtt
from meshllm.mesh.gossip import Gossip
from meshllm.mesh.records import RttEntry

K = [make_key(40 + i) for i in range(3)]
IDS = [make_record(k).node_id for k in K]


def test_row_keeps_fresh_samples_only() -> None:
    table = rtt.observe_rtt({}, "a", 10.04, "direct", now=0.0)
    table = rtt.observe_rtt(table, "b", 80.0, "relay", now=50.0)
    assert rtt.current_row(table, now=55.0, max_age=30.0) == {"b": RttEntry(80.0, "relay")}
    assert rtt.current_row(table, now=10.0, max_age=30.0)["a"] == RttEntry(10.0, "direct")


def test_row_changed_ignores_jitter() -> None:
    """Only a move out of the 4x band counts (a loaded host's round trips swing 3-7x), and RTTs under
    10 ms are alike: 16 processes on one host re-signed every record each second when 20 % counted."""
    base = {"a": RttEntry(50.0, "direct")}
    assert not rtt.row_changed(base, {"a": RttEntry(55.0, "direct")})
    assert not rtt.row_changed(base, {"a": RttEntry(190.0, "direct")})
    assert rtt.row_changed(base, {"a": RttEntry(210.0, "direct")})
    assert rtt.row_changed(base, {"a": RttEntry(12.0, "direct")})
    assert rtt.row_changed(base, {"a": RttEntry(50.0, "relay")})
    assert not rtt.row_changed(base, {})  # a peer leaving the row waits for the refresh
    assert not rtt.row_changed({"a": RttEntry(0.4, "direct")}, {"a": RttEntry(25.0, "direct")})
    assert rtt.row_changed({"a": RttEntry(0.4, "direct")}, {"a": RttEntry(45.0, "direct")})


def test_new_peers_count_only_while_the_row_fills() -> None:
    """A young node publishes each new peer at once; past ROW_FILL peers, rotation and connection churn
    wait for the 30 s refresh (counting them re-signed some record of a 50-node mesh 15 times a second)."""
    young = {f"p{i}": RttEntry(20.0, "direct") for i in range(rtt.ROW_FILL - 1)}
    assert rtt.row_changed(young, {**young, "new": RttEntry(20.0, "direct")})
    full = {f"p{i}": RttEntry(20.0, "direct") for i in range(rtt.ROW_FILL)}
    assert not rtt.row_changed(full, {**full, "new": RttEntry(20.0, "direct")})
    assert not rtt.row_changed(full, {k: v for k, v in full.items() if k != "p0"})
    assert rtt.row_changed(full, {**full, "p0": RttEntry(200.0, "direct")})  # a published peer moved


def test_matrix_is_the_union_of_rows_with_symmetric_fill() -> None:
    a = make_record(K[0], rtt={IDS[1]: RttEntry(10.0, "direct"), "gone": RttEntry(5.0, "direct")})
    b = make_record(K[1], rtt={IDS[2]: RttEntry(30.0, "relay")})
    c = make_record(K[2], rtt={IDS[1]: RttEntry(32.0, "relay")})
    m = rtt.rtt_matrix([a, b, c])
    assert m[IDS[0]] == {IDS[1]: 10.0}
    assert m[IDS[1]] == {IDS[0]: 10.0, IDS[2]: 30.0}  # A->B filled in from A's row
    assert m[IDS[2]] == {IDS[1]: 32.0}  # both directions measured: each keeps its own


def test_observed_rtt_is_published_and_reaches_every_matrix() -> None:
    net = SimNet(5, seed=7)
    net.run_until(4.0)
    a, b = net.ids[0], net.ids[1]
    net.nodes[a].gossip.observe_rtt(b, 42.0, "direct", net.now)
    net.run_until(net.now + 4.0)
    assert net.nodes[a].gossip.own.rtt == {b: RttEntry(42.0, "direct")}
    for node in net.live():
        m = node.gossip.rtt_matrix()
        assert m[a][b] == 42.0 and m[b][a] == 42.0


def test_small_changes_do_not_resign() -> None:
    g = Gossip(K[0], make_record(K[0]), make_verifier(), random.Random(0), now=0.0)
    g.observe_rtt(IDS[1], 20.0, "direct", 0.0)
    g.tick(0.1)
    seq = g.own.seq
    g.observe_rtt(IDS[1], 21.0, "direct", 0.2)
    g.tick(0.3)
    assert g.own.seq == seq
