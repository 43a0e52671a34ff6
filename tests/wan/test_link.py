"""The sans-IO link model: delay, jitter without reordering, loss, bandwidth cap and tail drops."""

from __future__ import annotations

import random

import pytest

from wan.link import LinkProfile, LinkState


def test_delay_is_one_way_and_rtt_halves() -> None:
    link = LinkState(LinkProfile.rtt(40))
    assert link.profile.delay_ms == 20.0
    assert link.offer(1.0, 100) == pytest.approx(1.020)
    assert link.stats.sent == 1 and link.stats.bytes == 100


def test_jitter_stays_in_bounds_and_never_reorders() -> None:
    link = LinkState(LinkProfile(delay_ms=20, jitter_ms=5), random.Random(7))
    departures = []
    for i in range(2000):
        now = i * 0.0005  # datagrams 0.5 ms apart: jitter alone would reorder many of them
        departure = link.offer(now, 1200)
        assert departure is not None
        assert now + 0.015 - 1e-9 <= departure
        departures.append(departure)
    assert departures == sorted(departures)
    delays = [d - i * 0.0005 for i, d in enumerate(departures)]
    assert max(delays) - min(delays) > 0.008  # it does vary


def test_random_loss_rate() -> None:
    link = LinkState(LinkProfile(loss=0.1), random.Random(3))
    lost = sum(link.offer(i * 0.001, 100) is None for i in range(20000))
    assert 1800 < lost < 2200
    assert link.stats.dropped_random == lost and link.stats.sent == 20000 - lost


def test_bandwidth_cap_serialises_and_tail_drops() -> None:
    # 8 Mbit/s: a 1,000-byte datagram takes 1 ms on the wire; the queue holds 10 ms
    link = LinkState(LinkProfile(delay_ms=5, bandwidth_mbps=8, queue_ms=10))
    out = [link.offer(0.0, 1000) for _ in range(20)]
    sent = [d for d in out if d is not None]
    assert sent[:3] == pytest.approx([0.006, 0.007, 0.008])
    assert len(sent) == 11  # 1 on the wire + 10 ms of queue, then the buffer is full
    assert link.stats.dropped_queue == 9
    assert link.offer(0.050, 1000) == pytest.approx(0.056)  # drained by then


@pytest.mark.parametrize("bad", [{"delay_ms": -1}, {"loss": 1.0}, {"loss": -0.1}, {"bandwidth_mbps": 0},
                                 {"jitter_ms": -2}])
def test_bad_profiles_are_refused(bad: dict) -> None:
    with pytest.raises(ValueError):
        LinkProfile(**bad)
