"""SWIM failure detector: probe, indirect probe, suspicion, external signals; kill detection in sim."""

from __future__ import annotations

import itertools
import random

import pytest
from sim import SimNet

from meshllm.mesh import view
from meshllm.mesh.failure import Failed, FailureDetector, Overstep, Probe, Recovered, Suspected
from meshllm.mesh.messages import HEALTH_MAX, Ack, Ping, PingReq

PEERS = ["p1", "p2", "p3", "p4"]


def detector() -> FailureDetector:
    return FailureDetector(random.Random(1), now=0.0)


def pings(out: list) -> dict[str, int]:
    return {o.to: o.message.nonce for o in out if isinstance(o, Probe) and isinstance(o.message, Ping)}


def test_answered_probe_raises_nothing() -> None:
    fd = detector()
    sent = pings(fd.tick(0.0, PEERS))
    assert set(sent) == set(PEERS)
    for peer, nonce in sent.items():
        assert fd.receive(peer, Ack(nonce), 0.1) == []
    assert not [o for o in fd.tick(1.0, PEERS) if not isinstance(o, Probe)]


def test_silent_peer_goes_indirect_then_suspect_then_failed() -> None:
    fd = detector()
    sent = pings(fd.tick(0.0, PEERS))
    for peer in PEERS[1:]:
        fd.receive(peer, Ack(sent[peer]), 0.05)
    out = fd.tick(0.3, PEERS)
    reqs = [o for o in out if isinstance(o.message, PingReq)]
    assert len(reqs) == 2 and {r.message.target for r in reqs} == {"p1"}
    assert "p1" not in {r.to for r in reqs}
    assert pings(out) == {"p1": sent["p1"]}  # a second direct try
    assert Suspected("p1") in fd.tick(0.7, ["p1"])
    assert fd.next_timer() <= 0.7 + fd.config.suspicion_timeout
    out = []
    while not out:  # ticking when asked (a tick run late would raise our score and defer the verdict)
        out = [o for o in fd.tick(fd.next_timer(), ["p1"]) if isinstance(o, Failed)]
    assert out == [Failed("p1")] and fd.health == 0
    assert fd.suspects == frozenset()


def helpers_of(out: list) -> dict[str, set[str]]:
    asked: dict[str, set[str]] = {}
    for o in out:
        if isinstance(o, Probe) and isinstance(o.message, PingReq):
            asked.setdefault(o.message.target, set()).add(o.to)
    return asked


def answer_all_but(fd: FailureDetector, sent: dict[str, int], silent: str) -> None:
    for peer, nonce in sent.items():
        if peer != silent:
            fd.receive(peer, Ack(nonce), 0.05)


def test_indirect_ack_clears_the_probe() -> None:
    fd = detector()
    sent = pings(fd.tick(0.0, PEERS))
    answer_all_but(fd, sent, "p1")
    helper = sorted(helpers_of(fd.tick(0.3, PEERS))["p1"])[0]
    assert fd.receive(helper, Ack(sent["p1"]), 0.4) == []  # relayed by a helper
    assert Suspected("p1") not in fd.tick(0.8, PEERS)


def test_nonces_are_random_62_bit() -> None:
    fd = detector()
    nonces = sorted(pings(fd.tick(0.0, [f"p{i}" for i in range(50)])).values())
    assert len(set(nonces)) == 50 and all(0 <= n < 2**62 for n in nonces)
    assert not any(b - a == 1 for a, b in itertools.pairwise(nonces))  # not sequential


def test_ack_from_anyone_but_the_target_is_ignored_before_going_indirect() -> None:
    fd = detector()
    sent = pings(fd.tick(0.0, PEERS))
    answer_all_but(fd, sent, "p1")
    assert fd.receive("p2", Ack(sent["p1"]), 0.1) == []  # a forged ack from another peer
    out = fd.tick(0.3, PEERS)
    assert "p1" in helpers_of(out)  # still unanswered: the forged ack did not count


def test_ack_from_a_peer_we_did_not_ask_is_ignored() -> None:
    fd = detector()
    peers = [*PEERS, "p5"]
    sent = pings(fd.tick(0.0, peers))
    answer_all_but(fd, sent, "p1")
    asked = helpers_of(fd.tick(0.3, peers))["p1"]
    stranger = sorted(set(peers) - asked - {"p1"})[0]
    fd.receive(stranger, Ack(sent["p1"]), 0.4)
    assert Suspected("p1") in fd.tick(0.7, peers)
    # The target's own ack still counts, even late: it clears the suspicion.
    fd2 = detector()
    sent2 = pings(fd2.tick(0.0, PEERS))
    fd2.tick(0.3, PEERS)
    assert fd2.receive("p1", Ack(sent2["p1"]), 0.4) == []
    assert Suspected("p1") not in fd2.tick(0.7, PEERS)


def test_relayed_ack_is_forwarded_only_from_the_target() -> None:
    fd = detector()
    (probe,) = fd.receive("asker", PingReq(77, "target"), 0.0)
    assert fd.receive("mallory", Ack(probe.message.nonce), 0.1) == []
    assert fd.receive("target", Ack(probe.message.nonce), 0.2) == [Probe("asker", Ack(77))]


def test_relays_ping_req_and_forwards_the_ack() -> None:
    fd = detector()
    (probe,) = fd.receive("asker", PingReq(77, "target"), 0.0)
    assert probe.to == "target" and isinstance(probe.message, Ping)
    assert fd.receive("target", Ack(probe.message.nonce), 0.1) == [Probe("asker", Ack(77))]


def test_answers_pings() -> None:
    assert detector().receive("p1", Ping(5), 0.0) == [Probe("p1", Ack(5))]


def test_external_signals_and_recovery() -> None:
    fd = detector()
    assert fd.suspect("p3", 1.0) == [Suspected("p3")]
    assert fd.suspect("p3", 1.2) == []
    assert fd.alive("p3") == [Recovered("p3")]
    fd.suspect("p4", 2.0)
    assert fd.receive("p4", Ping(1), 2.1)[0] == Recovered("p4")  # any message proves life
    assert fd.health == 2  # two wrong suspicions: the next one waits three times as long ...
    fd.suspect("p2", 3.0)
    assert fd.tick(5.9, []) == []
    assert fd.tick(6.0, []) == []  # ... and, our score not being 0, its verdict waits too
    assert fd.tick(65.9, []) == []
    assert fd.tick(66.0, []) == [Failed("p2")]  # for at most verdict_wait


def test_a_verdict_waits_while_our_loop_runs_late() -> None:
    """A suspect's timeout running out while our own score is not 0 leaves it suspect, rechecked less often,
    until answers in time bring our score back to 0 (then it fails at once), or it answers first."""
    fd = detector()
    run(fd, 0.0, 3.0, "")
    late = fd.next_timer() + 1.0
    fd.tick(late, [])  # a late tick: health 1
    assert fd.health == 1
    assert fd.suspect("p1", late) == [Suspected("p1")]
    due = late + 2 * fd.config.suspicion_timeout  # stretched by our score
    out = []
    now = late
    while now < due + 5.0:  # p1, the only peer we watch now, never answers: nothing lowers our score
        now = fd.next_timer()
        out += fd.tick(now, ["p1"])
    assert Failed("p1") not in out and fd.suspects == {"p1"} and fd.health == 1
    rechecks = [o for o in out if isinstance(o, Probe) and o.to == "p1"]
    assert 0 < len(rechecks) <= (now - late) / (2 * fd.config.recheck_interval) + 1  # stretched too
    sent: dict[str, int] = {}
    while "p2" not in sent:  # p2 joins the peers we watch
        now = fd.next_timer()
        sent = pings(fd.tick(now, ["p1", "p2"]))
    fd.receive("p2", Ack(sent["p2"]), now + 0.01)  # and answers in time: our score is 0 again
    assert fd.health == 0
    assert fd.next_timer() <= now + 0.01 and Failed("p1") in fd.tick(now + 0.02, ["p1", "p2"])


def test_a_suspicion_the_suspect_clears_stretches_our_timeouts() -> None:
    """A suspect that answers was alive: our timeouts were shorter than this host's or network's delays
    (a saturated host's peers answer late while our own ticks keep time). The score rises as for a late
    tick, so the next probes wait longer and come less often; answers in time bring it back down."""
    fd = detector()
    run(fd, 0.0, 3.0, "")
    assert fd.health == 0
    out = run(fd, 3.0, 6.0, "p1")  # p1 stops answering: indirect, then suspected
    assert Suspected("p1") in out and fd.health == 0  # a probe that times out says nothing yet
    assert fd.alive("p1") == [Recovered("p1")]
    assert fd.health == 1 and fd.stretch("p2") == 2  # as after a late tick (the test above)
    run(fd, 6.0, 9.0, "")
    assert fd.health == 0


def test_killed_node_leaves_every_view_within_five_seconds() -> None:
    net = SimNet(30, seed=9, loss=0.02, preseed=True)
    net.run_until(3.0)
    victim = net.ids[5]
    removed: dict[str, float] = {}
    net.observers.append(
        lambda node, ev: removed.setdefault(node.id, net.now)
        if isinstance(ev, view.PeerRemoved) and ev.node_id == victim
        else None
    )
    killed_at = net.now
    net.kill(victim)
    net.run_until(killed_at + 5.0)
    assert set(removed) == {n.id for n in net.live()}
    assert max(removed.values()) - killed_at < 5.0
    for node in net.live():
        assert node.gossip.state.peers[victim].status == "down"


def test_probes_beyond_the_rate_are_dropped_and_reported() -> None:
    fd = detector()
    out = [fd.receive("p1", Ping(n), 0.0) for n in range(40)]
    assert out[:20] == [[Probe("p1", Ack(n))] for n in range(20)]  # the burst is answered
    assert all(o == [Overstep("p1", o[0].reason)] for o in out[20:])  # the rest dropped and reported
    assert fd.receive("p1", Ping(99), 0.2) == [Probe("p1", Ack(99))]  # the rate refills


def test_a_peer_cannot_make_us_ping_others_without_bound() -> None:
    fd = detector()
    probes = [p for n in range(12) for p in fd.receive("asker", PingReq(n, f"t{n}"), 0.0)]
    assert len(probes) == 8  # RELAYS_PER_PEER in flight
    fd.tick(1.0, [])  # the relays expire
    assert fd.receive("asker", PingReq(1, "asker"), 1.0) == []  # nor may it ping itself through us
    assert len(fd.receive("asker", PingReq(2, "t2"), 1.0)) == 1


def test_a_death_reaches_nodes_that_never_probed_the_victim() -> None:
    """100 nodes, partial views of 10: most nodes never probe the victim, its watchers tell them."""
    net = SimNet(100, seed=3, loss=0.01, preseed=True)
    net.run_until(2.0)
    victim = net.ids[4]
    watchers = {n.id for n in net.live() if victim in n.gossip.watched()}
    connected = {n.id for n in net.live() if victim in n.gossip.connected}
    assert 0 < len(watchers) < len(connected) < 99
    removed: dict[str, float] = {}
    net.observers.append(
        lambda node, ev: removed.setdefault(node.id, net.now)
        if isinstance(ev, view.PeerRemoved) and ev.node_id == victim
        else None
    )
    killed_at = net.now
    net.kill(victim)
    net.run_until(killed_at + 5.0)
    assert set(removed) == {n.id for n in net.live() if n.id != victim}
    assert max(removed.values()) - killed_at < 3.0  # simulated clock: detection plus a few hops


def test_a_suspect_is_rechecked_until_it_answers() -> None:
    """A suspect is pinged every ``recheck_interval``, directly and through one other peer (a different one
    each time, as drawn), so a peer that was only slow, or that our own path to fails, has several chances
    to answer within the suspicion timeout; its answer, or a helper's relayed one, clears it."""
    fd = detector()
    answer_all_but(fd, pings(fd.tick(0.0, PEERS)), "")
    assert fd.suspect("p1", 0.1) == [Suspected("p1")]
    rechecks: list[int] = []
    helpers: list[str] = []
    now = 0.1
    while now < 0.1 + fd.config.suspicion_timeout - 0.01:
        out = fd.tick(now, PEERS)
        assert not [o for o in out if isinstance(o, Failed)]
        new = [nonce for peer, nonce in pings(out).items() if peer == "p1"]
        reqs = [o for o in out if isinstance(o, Probe) and isinstance(o.message, PingReq)]
        assert {(r.message.target, r.message.nonce) for r in reqs} <= {("p1", n) for n in new}
        rechecks += new
        helpers += [r.to for r in reqs]
        now = min(fd.next_timer(), now + 0.05)
    assert len(helpers) >= 3 and "p1" not in helpers and len(set(helpers)) > 1
    assert fd.receive("p1", Ack(rechecks[-1]), now) == [Recovered("p1")]
    assert fd.suspects == frozenset()
    # again, cleared this time by the helper that reached it
    assert fd.suspect("p1", now) == [Suspected("p1")]
    out = fd.tick(fd.next_timer(), PEERS)
    req = next(o for o in out if isinstance(o, Probe) and isinstance(o.message, PingReq))
    assert fd.receive("p2" if req.to != "p2" else "p3", Ack(req.message.nonce), now) == []  # not a helper we asked
    assert fd.receive(req.to, Ack(req.message.nonce), now) == [Recovered("p1")]


def test_a_late_tick_gives_every_suspect_a_whole_suspicion_timeout_again() -> None:
    """Acks missed while our loop ran late may have been waiting for it: a late tick restarts every
    suspicion's clock. A real death is still found: the verdict comes a suspicion timeout after the last
    late tick, and ``verdict_wait`` after the first deadline at the latest, however late the loop runs."""
    fd = detector()
    run(fd, 0.0, 3.0, "")
    assert fd.suspect("p1", 3.0) == [Suspected("p1")]
    due = 3.0 + fd.config.suspicion_timeout
    fd.tick(fd.next_timer(), ["p1"])  # on time
    late = fd.next_timer() + 0.3
    fd.tick(late, ["p1"])  # late: our score is 1 and the clock restarts
    assert fd.health == 1 and fd.suspects == {"p1"}
    sent: dict[str, int] = {}
    now = late
    while "p2" not in sent:  # p2 answers in time: our score is 0 again, before the old deadline
        now = fd.next_timer()
        sent = pings(fd.tick(now, ["p1", "p2"]))
    fd.receive("p2", Ack(sent["p2"]), now)
    assert fd.health == 0
    assert Failed("p1") not in fd.tick(due + 0.01, ["p1", "p2"])  # the old deadline: not yet
    verdict = late + 2 * fd.config.suspicion_timeout  # stretched by the score the late tick raised
    out: list = []
    while not out and now < verdict + 1.0:
        now = fd.next_timer()
        out = [o for o in fd.tick(now, ["p1", "p2"]) if isinstance(o, Failed)]
        for peer, nonce in pings(fd.tick(now, ["p2"])).items():
            fd.receive(peer, Ack(nonce), now)
    assert out == [Failed("p1")] and now == pytest.approx(verdict, abs=0.3)


def run(fd: FailureDetector, start: float, end: float, silent: str) -> list:
    """Tick on time (as a driver whose loop keeps up does) from ``start`` to ``end``; every peer but
    ``silent`` answers each ping at once. Returns everything the detector put out."""
    out: list = []
    now = start
    while True:
        now = min(end, max(now + 1e-3, fd.next_timer()))
        ticked = fd.tick(now, PEERS)
        out += ticked
        for peer, nonce in pings(ticked).items():
            if peer != silent:
                fd.receive(peer, Ack(nonce), now)
        if now >= end:
            return out


def test_late_ticks_raise_local_health_and_stretch_our_timeouts() -> None:
    """Lifeguard's local health: a tick that runs late says our loop is overloaded, so we probe less often
    and wait longer before suspecting; answers that arrive in time bring the score back down."""
    fd = detector()
    run(fd, 0.0, 3.0, "")
    assert fd.health == 0 and fd.stretch("p1") == 1
    late = fd.next_timer() + 0.5
    out = fd.tick(late, PEERS)  # the probe round, half a second late
    sent = pings(out)
    assert fd.health == 1 and fd.stretch("p1") == 2 and set(sent) == set(PEERS)
    assert all(o.message.health == 1 for o in out if isinstance(o, Probe))
    assert fd.next_timer() == pytest.approx(late + 2 * fd.config.ack_timeout)  # the ack timeout doubled
    for peer, nonce in sent.items():
        fd.receive(peer, Ack(nonce), late + 0.1)
    assert fd.health == 0  # answered in time: healthy again
    assert fd.next_timer() == pytest.approx(late + 2 * fd.config.probe_interval)  # the period, set late, too


def test_health_is_bounded() -> None:
    fd = detector()
    now = 0.0
    for _ in range(20):
        fd.tick(now, [])
        now = fd.next_timer() + 1.0  # every tick a second late
    assert fd.health == HEALTH_MAX
    start = fd.next_timer()
    fd.tick(start, PEERS)
    assert fd.next_timer() == pytest.approx(start + fd.config.ack_timeout * (1 + HEALTH_MAX))


def test_a_peer_that_says_it_is_overloaded_gets_longer_to_answer() -> None:
    """A peer's health comes with its pings and acks; probing it, we wait 1 + its score times as long
    for each step: the ack, the indirect probe, the suspicion."""
    fd = detector()
    assert fd.receive("p1", Ping(5, health=3), 0.0) == [Probe("p1", Ack(5, 0))]
    assert fd.stretch("p1") == 4 and fd.stretch("p2") == 1
    cfg = fd.config
    indirect_at = 4 * cfg.ack_timeout
    assert "p1" not in helpers_of(run(fd, 0.0, indirect_at - 0.01, "p1"))
    assert "p1" in helpers_of(run(fd, indirect_at - 0.01, indirect_at + 0.01, "p1"))
    suspected_at = indirect_at + 4 * cfg.indirect_timeout
    assert Suspected("p1") not in run(fd, indirect_at + 0.01, suspected_at - 0.01, "p1")
    assert Suspected("p1") in run(fd, suspected_at - 0.01, suspected_at + 0.01, "p1")
    failed_at = suspected_at + 4 * cfg.suspicion_timeout
    assert Failed("p1") not in run(fd, suspected_at + 0.01, failed_at - 0.01, "p1")
    assert Failed("p1") in run(fd, failed_at - 0.01, failed_at + 0.01, "p1")
    assert fd.health == 0 and fd.stretch("p1") == 1  # forgotten with the peer


def test_relayed_acks_carry_the_targets_health() -> None:
    fd = detector()
    (probe,) = fd.receive("asker", PingReq(77, "target"), 0.0)
    assert fd.receive("target", Ack(probe.message.nonce, health=5), 0.1) == [Probe("asker", Ack(77, 5))]
