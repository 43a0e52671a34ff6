"""Backoff policy (sans-IO) and the dial_with_retry loop (against a fake endpoint)."""

from __future__ import annotations

import asyncio
import random
import time

import pytest

from meshllm.net import AdmissionRefused, Backoff, ConnectError, ConnectTimeout, dial_with_retry


def test_delays_grow_exponentially_up_to_the_cap_without_jitter() -> None:
    b = Backoff(initial=0.1, factor=2, maximum=1.0, jitter=0)
    assert [round(b.next_delay(), 3) for _ in range(6)] == [0.1, 0.2, 0.4, 0.8, 1.0, 1.0]
    b.reset()
    assert b.next_delay() == 0.1


def test_a_peer_that_always_fails_cannot_overflow_the_delay() -> None:
    """The failure count is attacker-driven: 2.0 ** 1024 overflows a float (it did, before)."""
    b = Backoff(initial=0.1, factor=2, maximum=5.0, jitter=0)
    for _ in range(5000):
        delay = b.next_delay()
    assert delay == 5.0


def test_jitter_stays_within_its_band() -> None:
    b = Backoff(initial=1.0, factor=1, maximum=1.0, jitter=0.5, rng=random.Random(7))
    delays = [b.next_delay() for _ in range(200)]
    assert all(0.5 <= d <= 1.0 for d in delays) and len(set(delays)) > 100


def test_bad_parameters_are_refused() -> None:
    with pytest.raises(ValueError):
        Backoff(initial=0)


class FakeEndpoint:
    def __init__(self, failures: list[Exception]) -> None:
        self.failures = failures
        self.calls = 0

    async def connect(self, addr, expected_node_id=None, timeout=5.0):  # type: ignore[no-untyped-def]
        self.calls += 1
        if self.failures:
            raise self.failures.pop(0)
        return "conn"


def run(coro):  # type: ignore[no-untyped-def]
    return asyncio.run(coro)


def test_retries_transient_failures_until_success() -> None:
    ep = FakeEndpoint([ConnectError("down"), ConnectTimeout("slow")])
    fast = Backoff(initial=0.001, maximum=0.002)
    assert run(dial_with_retry(ep, ("h", 1), deadline=5, backoff=fast)) == "conn"  # type: ignore[arg-type]
    assert ep.calls == 3


def test_permanent_refusal_is_not_retried() -> None:
    ep = FakeEndpoint([AdmissionRefused("banned")])
    with pytest.raises(AdmissionRefused):
        run(dial_with_retry(ep, ("h", 1), deadline=5))  # type: ignore[arg-type]
    assert ep.calls == 1


def test_a_stalled_loop_past_the_deadline_still_reports_the_last_error() -> None:
    """A backoff sleep that ends past the deadline (the loop was held up: a busy host) reports what failed,
    not a bare timeout (CI saw "could not connect to h:1 within 0.2s" instead of "down")."""
    ep = FakeEndpoint([ConnectError("down")] * 1000)

    async def main() -> None:
        async def stall() -> None:
            await asyncio.sleep(0.01)
            time.sleep(0.3)  # holds the loop past the dial's deadline, during its backoff sleep

        stalling = asyncio.ensure_future(stall())
        with pytest.raises(ConnectError, match="down"):
            await dial_with_retry(ep, ("h", 1), deadline=0.2, backoff=Backoff(initial=0.05, maximum=0.05))  # type: ignore[arg-type]
        await stalling

    run(main())
    assert ep.calls == 1


def test_gives_up_at_the_deadline_with_the_last_error() -> None:
    ep = FakeEndpoint([ConnectError("down")] * 1000)
    with pytest.raises(ConnectError, match="down"):
        run(dial_with_retry(ep, ("h", 1), deadline=0.2, backoff=Backoff(initial=0.05, maximum=0.05)))  # type: ignore[arg-type]
    assert ep.calls >= 2  # retried, then gave up (how many times depends on the machine's speed)
