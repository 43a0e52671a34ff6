"""Per-peer limits (sans-IO): token buckets, strikes, cool-downs; every table bounded."""

from __future__ import annotations

import pytest

from meshllm.net.limits import ByteRate, CoolDowns, RateLimit, Strikes


def test_rate_limit_allows_a_burst_then_the_rate() -> None:
    limit: RateLimit[str] = RateLimit(rate=2.0, burst=4.0)
    assert [limit.allow("p", 0.0) for _ in range(5)] == [True] * 4 + [False]
    assert limit.allow("p", 0.5) and not limit.allow("p", 0.5)  # one token back per half second
    assert limit.allow("q", 0.5)  # buckets are per key
    assert [limit.allow("p", 100.0) for _ in range(5)] == [True] * 4 + [False]  # refills to the burst only


def test_rate_limit_is_bounded_and_survives_a_clock_step_back() -> None:
    limit: RateLimit[int] = RateLimit(rate=1.0, burst=1.0, size=8)
    for key in range(1000):
        limit.allow(key, 0.0)
    assert len(limit._buckets.items) == 8
    assert limit.allow(999, 10.0) and not limit.allow(999, 5.0)  # backwards: no tokens granted


def test_bad_rate_limits_are_refused() -> None:
    with pytest.raises(ValueError):
        RateLimit(rate=0.0, burst=1.0)


def test_strikes_count_inside_their_window() -> None:
    strikes: Strikes[str] = Strikes(limit=3, window_s=10.0)
    assert not strikes.add("p", 0.0) and not strikes.add("p", 1.0)
    assert not strikes.add("p", 20.0)  # the first two fell out of the window
    assert not strikes.add("p", 21.0)
    assert strikes.add("p", 22.0)  # three inside ten seconds
    assert not strikes.add("p", 23.0)  # the count restarts after reaching the limit


def test_cool_downs_expire() -> None:
    cooling: CoolDowns[str] = CoolDowns(size=2)
    cooling.add("p", 0.0, 30.0)
    assert cooling.remaining("p", 10.0) == 20.0
    assert cooling.remaining("p", 30.0) == 0.0 and cooling.remaining("q", 0.0) == 0.0
    for key in "abc":
        cooling.add(key, 0.0, 30.0)
    assert cooling.remaining("a", 1.0) == 0.0  # the table holds two: the oldest went


def test_a_byte_rate_lets_a_burst_through_then_books_waits_in_order() -> None:
    rate = ByteRate(rate=1000.0, burst=500.0)
    assert rate.reserve(500, 0.0) == 0.0  # the burst goes at once
    assert rate.reserve(250, 0.0) == pytest.approx(0.25)  # then each booking waits its turn ...
    assert rate.reserve(250, 0.0) == pytest.approx(0.5)  # ... behind the ones booked before it
    assert rate.reserve(1000, 0.5) == pytest.approx(1.0)  # 0.5 s refilled 500 of the 500 owed
    assert rate.reserve(100, 100.0) == 0.0  # idle time refills to the burst only
    assert rate.reserve(500, 100.0) == pytest.approx(0.1)


def test_a_byte_rate_over_many_bookings_holds_its_rate() -> None:
    rate, now = ByteRate(rate=4e6, burst=64e3), 0.0
    for _ in range(100):  # 100 x 256 KiB, each sent when its wait says
        now += rate.reserve(256 << 10, now)
    assert (100 * (256 << 10) - 64e3) / now == pytest.approx(4e6)


def test_bad_byte_rates_are_refused() -> None:
    with pytest.raises(ValueError):
        ByteRate(rate=0.0, burst=1.0)
    with pytest.raises(ValueError):
        ByteRate(rate=1.0, burst=0.0)
