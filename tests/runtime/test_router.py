"""The sans-IO routing core: ordering, affinity, cooldowns, failover."""

from __future__ import annotations

import pytest

from meshllm.engine.base import ChatMessage, ChatRequest, CompletionRequest
from meshllm.runtime.router import Attempt, PeerView, Router, RouterConfig, Target, affinity_key, rendezvous_score

M = "model-x"


def peer(node_id: str, load: int = 0, rtt: float | None = 10.0, models: tuple[str, ...] = (M,),
         alive: bool = True, free: int | None = None) -> PeerView:
    return PeerView(node_id=node_id, models=frozenset(models), load=load, rtt_ms=rtt, alive=alive, free_slots=free)


def ids(targets: list[Target]) -> list[str]:
    return [t.node_id for t in targets]


def test_local_first_then_peers_by_rtt_plus_load() -> None:
    router = Router("me", RouterConfig(load_cost_ms=100.0, unknown_rtt_ms=50.0))
    peers = [peer("far", rtt=80), peer("near-busy", rtt=5, load=1), peer("near", rtt=20), peer("unprobed", rtt=None)]
    order = router.order(M, local_models=[M], peers=peers, now=0.0)
    assert order[0] == Target("me", local=True)
    # costs: near 20, unprobed 50, far 80, near-busy 5 + 100
    assert ids(order) == ["me", "near", "unprobed", "far", "near-busy"]


def test_only_live_peers_serving_the_model_and_never_self_as_peer() -> None:
    router = Router("me")
    peers = [peer("other-model", models=("y",)), peer("dead", alive=False), peer("me"), peer("ok")]
    assert ids(router.order(M, local_models=[], peers=peers, now=0.0)) == ["ok"]
    assert router.order("unknown", local_models=[M], peers=peers, now=0.0) == []


def test_affinity_peer_goes_first_and_is_stable() -> None:
    router = Router("me")
    peers = [peer(f"p{i}", rtt=float(i)) for i in range(6)]
    key = "user:alice"
    owner = max(peers, key=lambda p: rendezvous_score(key, p.node_id)).node_id
    order = ids(router.order(M, local_models=[], peers=peers, now=0.0, key=key))
    assert order[0] == owner
    assert sorted(order) == sorted(p.node_id for p in peers)
    # another node computes the same owner; removing a non-owner peer does not move the session
    others = [p for p in peers if p.node_id not in (owner, "p0" if owner != "p0" else "p1")] + [
        next(p for p in peers if p.node_id == owner)]
    assert ids(Router("elsewhere").order(M, local_models=[], peers=others, now=0.0, key=key))[0] == owner
    # local still beats affinity
    assert ids(router.order(M, local_models=[M], peers=peers, now=0.0, key=key))[:2] == ["me", owner]


def test_overloaded_affinity_peer_loses_priority() -> None:
    router = Router("me", RouterConfig(affinity_max_load=2))
    key = "user:bob"
    peers = [peer("a"), peer("b")]
    owner = ids(router.order(M, local_models=[], peers=peers, now=0.0, key=key))[0]
    busy = [peer(p.node_id, load=5 if p.node_id == owner else 0) for p in peers]
    assert ids(router.order(M, local_models=[], peers=busy, now=0.0, key=key))[0] != owner


def test_free_slots_come_first_and_a_busy_local_engine_waits_behind_them() -> None:
    router = Router("me", RouterConfig(load_cost_ms=100.0))
    peers = [peer("full-near", rtt=1, load=8, free=0), peer("free-far", rtt=60, load=7, free=1),
             peer("free-near", rtt=20, load=2, free=6), peer("old-idle", rtt=30), peer("old-busy", rtt=2, load=1)]
    assert ids(router.order(M, local_models=[M], peers=peers, now=0.0, local_free=3)) == [
        "me", "free-near", "old-idle", "free-far", "old-busy", "full-near"]
    # all local slots taken: peers that start the request at once go first, then this node, then the rest
    assert ids(router.order(M, local_models=[M], peers=peers, now=0.0, local_free=0)) == [
        "free-near", "old-idle", "free-far", "me", "old-busy", "full-near"]


def test_an_affinity_peer_without_a_free_slot_loses_priority() -> None:
    router = Router("me")
    key = "user:carol"
    peers = [peer("a", free=2), peer("b", free=2), peer("c", free=2)]
    owner = ids(router.order(M, local_models=[], peers=peers, now=0.0, key=key))[0]
    full = [peer(p.node_id, load=4 if p.node_id == owner else 0, free=0 if p.node_id == owner else 2) for p in peers]
    assert ids(router.order(M, local_models=[], peers=full, now=0.0, key=key))[-1] == owner
    # a busy owner with free slots keeps its sessions (its cache holds their prefix)
    busy = [peer(p.node_id, load=6 if p.node_id == owner else 0, free=2) for p in peers]
    assert ids(router.order(M, local_models=[], peers=busy, now=0.0, key=key))[0] == owner


def test_affinity_key_prefers_user_then_system_prompt_and_tools() -> None:
    sys_msg = ChatMessage("system", "You are a pirate.")
    a = ChatRequest(model=M, messages=(sys_msg, ChatMessage("user", "hi")))
    b = ChatRequest(model=M, messages=(sys_msg, ChatMessage("user", "bye")))
    c = ChatRequest(model=M, messages=(ChatMessage("system", "Other"), ChatMessage("user", "hi")))
    tools = ({"type": "function", "function": {"name": "f"}},)
    assert affinity_key(a) == affinity_key(b) != affinity_key(c)
    assert affinity_key(ChatRequest(model=M, messages=a.messages, tools=tools)) != affinity_key(a)
    assert affinity_key(ChatRequest(model=M, messages=a.messages, user="u1")) == "user:u1"
    assert affinity_key(ChatRequest(model=M, messages=(ChatMessage("user", "hi"),))) is None
    assert affinity_key(CompletionRequest(model=M, prompt="x")) is None


def test_cooldown_doubles_and_is_capped_and_success_clears_it() -> None:
    router = Router("me", RouterConfig(cooldown_base_s=1.0, cooldown_max_s=5.0))
    assert [router.record_failure("p", now=100.0) - 100.0 for _ in range(5)] == [1.0, 2.0, 4.0, 5.0, 5.0]
    assert router.cooling_until("p", now=104.0) == 105.0
    assert router.cooling_until("p", now=105.0) is None
    router.record_failure("p", now=200.0)
    assert router.cooling_until("p", now=200.0) == 205.0  # still capped: failures accumulate
    router.record_success("p")
    assert router.cooling_until("p", now=200.0) is None
    assert router.record_failure("p", now=300.0) == 301.0


def test_cooling_peers_go_last_soonest_first_then_return() -> None:
    router = Router("me")
    peers = [peer("a", rtt=1), peer("b", rtt=2), peer("c", rtt=3)]
    router.record_failure("a", now=0.0)  # until 1
    router.record_failure("b", now=0.0)
    router.record_failure("b", now=0.0)  # until 2... then doubled: 2
    assert ids(router.order(M, local_models=[], peers=peers, now=0.5)) == ["c", "a", "b"]
    assert ids(router.order(M, local_models=[], peers=peers, now=1.5)) == ["a", "c", "b"]
    assert ids(router.order(M, local_models=[], peers=peers, now=3.0)) == ["a", "b", "c"]


def test_cooling_affinity_owner_is_skipped() -> None:
    router = Router("me")
    peers = [peer("a"), peer("b"), peer("c")]
    key = "user:carol"
    owner = ids(router.order(M, local_models=[], peers=peers, now=0.0, key=key))[0]
    router.record_failure(owner, now=0.0)
    order = ids(router.order(M, local_models=[], peers=peers, now=0.1, key=key))
    assert order[0] != owner and order[-1] == owner


def test_failover_walks_the_order_until_the_first_byte() -> None:
    router = Router("me")
    targets = router.order(M, local_models=[M], peers=[peer("a", rtt=1), peer("b", rtt=2)], now=0.0)
    attempt = Attempt(targets, router)
    assert attempt.next_target() == Target("me", local=True)
    assert attempt.failed(now=10.0) is True
    assert attempt.next_target() == Target("a")
    assert attempt.failed(now=10.0) is True
    assert attempt.next_target() == Target("b")
    attempt.first_byte()
    assert attempt.failed(now=10.0) is False  # text already reached the client
    assert attempt.next_target() is None
    assert all(router.cooling_until(n, now=10.5) for n in ("me", "a", "b"))


def test_failover_ends_when_targets_run_out_and_success_heals() -> None:
    router = Router("me")
    attempt = Attempt([Target("a")], router)
    assert attempt.next_target() == Target("a")
    assert attempt.failed(now=0.0) is False
    assert attempt.next_target() is None
    again = Attempt([Target("a")], router)
    again.next_target()
    again.succeeded()
    assert router.cooling_until("a", now=0.0) is None


@pytest.mark.parametrize("n", [2, 5, 20])
def test_rendezvous_spreads_keys_over_peers(n: int) -> None:
    nodes = [f"node{i}" for i in range(n)]
    owners = {max(nodes, key=lambda x, k=k: rendezvous_score(f"user:{k}", x)) for k in range(400)}
    assert owners == set(nodes)
