"""ProbeState: RTT EWMA and liveness, driven by a fake clock."""

from __future__ import annotations

from meshllm.net.probes import Liveness, ProbeState


def echo(state: ProbeState, datagram: bytes, now: float):  # type: ignore[no-untyped-def]
    """What the peer answers (its own ProbeState answers pings)."""
    (pong,) = ProbeState(0.0).receive(datagram, now).datagrams
    return state.receive(pong, now)


def test_rtt_is_an_ewma_of_pong_delays() -> None:
    p = ProbeState(0.0, alpha=0.5)
    assert p.rtt_ms is None
    (ping,) = p.poll(0.0).datagrams
    echo(p, ping, 0.010)
    assert abs(p.rtt_ms - 10.0) < 1e-6  # type: ignore[operator]
    (ping,) = p.poll(0.25).datagrams
    echo(p, ping, 0.27)
    assert abs(p.rtt_ms - 15.0) < 1e-6  # type: ignore[operator]


def test_three_missed_probes_make_the_peer_suspect_and_a_pong_revives_it() -> None:
    p = ProbeState(0.0, interval=0.25, suspect_after=3)
    p.poll(0.0)
    assert p.poll(0.1).datagrams == []  # not due yet
    for t in (0.25, 0.5):
        out = p.poll(t)
        assert out.events == [] and p.state is Liveness.ALIVE
    out = p.poll(0.75)
    assert [e.state for e in out.events] == [Liveness.SUSPECT] and p.missed == 3
    assert p.poll(1.0).events == []  # reported once
    (ping,) = p.poll(1.25).datagrams
    revived = echo(p, ping, 1.26)
    assert [e.state for e in revived.events] == [Liveness.ALIVE] and p.missed == 0


def test_late_pongs_keep_a_slow_peer_alive() -> None:
    """A peer answering every ping 400 ms late (past the 250 ms interval: a busy loop or host) is slow,
    not gone: its late pongs count, so it never turns suspect. Pings answered too late to count (older
    than the last ``suspect_after``) do not revive it."""
    p = ProbeState(0.0, interval=0.25, suspect_after=3)
    sent: list[tuple[float, bytes]] = []
    events = []
    for step in range(40):
        now = step * 0.05
        out = p.poll(now)
        events += out.events
        sent += [(now, d) for d in out.datagrams]
        while sent and sent[0][0] + 0.4 <= now:
            events += echo(p, sent.pop(0)[1], now).events
    assert events == [] and p.state is Liveness.ALIVE and 350 < p.rtt_ms < 450  # type: ignore[operator]

    q = ProbeState(0.0, interval=0.25, suspect_after=3)
    (first,) = q.poll(0.0).datagrams
    for t in (0.25, 0.5, 0.75):
        q.poll(t)
    assert q.state is Liveness.SUSPECT
    assert echo(q, first, 0.8).events == []  # four pings ago: no longer counted


def test_unknown_pong_and_garbage_are_ignored() -> None:
    p = ProbeState(0.0)
    (ping,) = p.poll(0.0).datagrams
    assert p.receive(b"\x02" + ping[1:], 0.1).events == []  # a pong for an unknown nonce... or a real one
    assert p.receive(b"junk", 0.1).datagrams == []
    assert p.receive(b"\x07" * len(ping), 0.1).datagrams == []


def test_ping_is_answered_with_a_pong_echoing_nonce_and_time() -> None:
    a, b = ProbeState(0.0), ProbeState(0.0)
    (ping,) = a.poll(5.0).datagrams
    (pong,) = b.receive(ping, 5.1).datagrams
    assert pong[0] == 2 and pong[1:] == ping[1:]


def test_a_ping_flood_gets_a_bounded_number_of_pongs() -> None:
    from meshllm.net.probes import MAX_PONGS_PER_INTERVAL

    flooder = ProbeState(0.0, interval=0.25)
    target = ProbeState(0.0, interval=0.25)
    (ping,) = flooder.poll(0.0).datagrams
    pongs = sum(len(target.receive(ping, 0.01 + i * 1e-4).datagrams) for i in range(1000))
    assert pongs == MAX_PONGS_PER_INTERVAL
    assert len(target.receive(ping, 0.3).datagrams) == 1  # a new interval answers again


def test_a_slow_pace_still_answers_a_peer_probing_at_full_pace() -> None:
    """Pongs are rationed per the pace a ProbeState was made with: one whose own pings slowed down
    (a quiet connection) still answers every ping of a peer with work on the connection."""
    quiet, busy = ProbeState(0.0, interval=0.25), ProbeState(0.0, interval=0.25)
    quiet.pace(5.0, 0.0)
    answered = 0
    for step in range(40):  # 10 s of pings at 4 a second
        now = step * 0.25
        for ping in busy.poll(now).datagrams:
            pongs = quiet.receive(ping, now + 0.001).datagrams
            answered += len(pongs)
            for pong in pongs:
                busy.receive(pong, now + 0.002)
    assert answered == 40 and busy.state is Liveness.ALIVE


def test_pace_sends_the_next_ping_now_and_forgives_those_in_flight() -> None:
    p = ProbeState(0.0, interval=5.0, suspect_after=3)
    assert len(p.poll(0.0).datagrams) == 1 and p.next_deadline == 5.0
    p.pace(0.25, 1.0)  # work started: the 5 s ping still in flight counts neither way
    assert p.next_deadline == 1.0 and p.interval == 0.25
    assert len(p.poll(1.0).datagrams) == 1 and p.missed == 0


def test_a_peer_heard_from_since_the_ping_is_not_missed() -> None:
    """A ping left unanswered while the peer's packets kept arriving (stream data, ACKs: its loop runs) is
    not missed, and revives a suspect; silence since the ping is a miss as before."""
    p = ProbeState(0.0, interval=0.25, suspect_after=3)
    p.poll(0.0)
    for t in (0.25, 0.5, 0.75, 1.0):
        assert p.poll(t, heard_at=t - 0.1).events == [] and p.missed == 0  # heard after each ping left
    assert p.state is Liveness.ALIVE
    for t in (1.25, 1.5, 1.75):
        out = p.poll(t, heard_at=0.9)  # silent since 0.9: each ping from 1.0 on is missed
    assert [e.state for e in out.events] == [Liveness.SUSPECT] and p.missed == 3
    revived = p.poll(2.0, heard_at=1.8)
    assert [e.state for e in revived.events] == [Liveness.ALIVE] and p.missed == 0
