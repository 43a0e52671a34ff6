"""No arithmetic on attacker-driven counters without a cap: the router's per-peer backoff.

Finding reproduced (it failed on the original main): 2,000 concurrent chats produced 243 HTTP 500s,
because ``Router.record_failure`` computed ``2 ** (failures - 1)`` before capping it and raised
``OverflowError`` past 1,024 consecutive failures of one peer.
"""

from __future__ import annotations

from meshllm.runtime.router import Attempt, PeerView, Router, RouterConfig, Target


def test_thousands_of_failures_in_a_row_keep_the_capped_cooldown() -> None:
    router = Router("me", RouterConfig(cooldown_base_s=1.0, cooldown_max_s=60.0))
    untils = [router.record_failure("peer", now=1000.0) for _ in range(5000)]
    assert untils[:3] == [1001.0, 1002.0, 1004.0]
    assert set(untils[6:]) == {1060.0}
    assert router.cooling_until("peer", 1000.0) == 1060.0


def test_failover_still_works_after_a_flood_of_failures() -> None:
    router = Router("me")
    peers = [PeerView("a", frozenset({"m"})), PeerView("b", frozenset({"m"}))]
    for _ in range(3000):
        attempt = Attempt(router.order("m", local_models=(), peers=peers, now=0.0), router)
        assert attempt.next_target() is not None
        attempt.failed(now=0.0)  # every request fails at its first target
    order = router.order("m", local_models=(), peers=peers, now=0.0)
    assert order == [Target("a"), Target("b")] or order == [Target("b"), Target("a")]
