"""The split planner: property tests (contiguous, covering, within memory, no excluded nodes) and choices."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from meshllm.split import Candidate, ModelProfile, NoChainFits, Plan, PlanOptions, Speculation, plan

GB = 1024**3
MODEL = ModelProfile(n_layers=24, layer_bytes=GB // 2, first_bytes=GB, last_bytes=GB, layer_flops=2e8, head_flops=4e8)


def rtts(ids: list[str], ms: float) -> dict[str, dict[str, float]]:
    return {a: {b: ms for b in ids if b != a} for a in ids}


def test_solo_when_the_requester_holds_everything() -> None:
    nodes = [Candidate("a", 64 * GB, gflops=50), Candidate("b", 64 * GB, gflops=50)]
    p = plan(MODEL, nodes, rtts(["a", "b"], 1.0), "a")
    assert p.solo and p.chain == [("a", 0, 24)]
    assert p.network_s == 0 and p.overhead_s == 0


def test_split_when_memory_demands_it() -> None:
    nodes = [Candidate("a", 8 * GB, gflops=50), Candidate("b", 10 * GB, gflops=50)]
    p = plan(MODEL, nodes, rtts(["a", "b"], 2.0), "a")
    assert [s.node_id for s in p.stages] == ["a", "b"]
    assert p.network_s == pytest.approx(0.002)  # a 2-stage ring is one RTT
    assert all(s.memory_bytes <= 10 * GB for s in p.stages)


def test_split_when_a_faster_node_pays_for_the_hop() -> None:
    nodes = [Candidate("slow", 64 * GB, gflops=1), Candidate("fast", 8 * GB, gflops=1000)]
    p = plan(MODEL, nodes, rtts(["slow", "fast"], 0.5), "slow")
    assert p.chain == [("slow", 0, 10), ("fast", 10, 24)]  # the fast node takes all its memory holds


def test_no_split_when_the_network_costs_more_than_it_saves() -> None:
    nodes = [Candidate("a", 64 * GB, gflops=100), Candidate("b", 64 * GB, gflops=120)]
    assert plan(MODEL, nodes, rtts(["a", "b"], 80.0), "a").solo


def test_forced_stage_count_and_memory_cap() -> None:
    nodes = [Candidate(n, 64 * GB, gflops=50) for n in "abc"]
    assert len(plan(MODEL, nodes, rtts(list("abc"), 1.0), "a", PlanOptions(stages=3)).stages) == 3
    capped = [Candidate(n, 6 * GB, gflops=50) for n in "abc"]  # every node capped by its own --max-memory
    chosen = plan(MODEL, capped, rtts(list("abc"), 1.0), "a")
    assert len(chosen.stages) >= 3 - 1 and all(s.memory_bytes <= 6 * GB for s in chosen.stages)


def test_relay_only_and_clients_are_never_stages() -> None:
    nodes = [
        Candidate("a", 8 * GB, gflops=10),
        Candidate("relay", 64 * GB, gflops=1000, relay_only=True),
        Candidate("client", 64 * GB, gflops=1000, role="client"),
        Candidate("b", 10 * GB, gflops=10),
    ]
    p = plan(MODEL, nodes, rtts(["a", "b", "relay", "client"], 1.0), "a")
    assert {s.node_id for s in p.stages} == {"a", "b"}


def test_requester_that_cannot_hold_a_layer_is_not_the_coordinator() -> None:
    nodes = [Candidate("tiny", GB // 2, gflops=10), Candidate("big", 64 * GB, gflops=10)]
    assert plan(MODEL, nodes, rtts(["tiny", "big"], 1.0), "tiny").chain == [("big", 0, 24)]


def test_no_chain_names_the_shortfall() -> None:
    nodes = [Candidate("a", 4 * GB), Candidate("b", 4 * GB)]
    with pytest.raises(NoChainFits) as err:
        plan(MODEL, nodes, rtts(["a", "b"], 1.0), "a")
    assert err.value.shortfall_bytes == 14 * GB - 8 * GB
    assert "GiB short" in str(err.value)


node_st = st.builds(
    Candidate,
    node_id=st.sampled_from([f"n{i}" for i in range(7)]),
    memory_bytes=st.integers(0, 16).map(lambda g: g * GB // 2),
    gflops=st.floats(0.5, 500),
    role=st.sampled_from(["host", "worker", "client"]),
    relay_only=st.booleans(),
)


@settings(max_examples=300, deadline=None)
@given(
    nodes=st.lists(node_st, min_size=1, max_size=6, unique_by=lambda c: c.node_id),
    layers=st.integers(1, 40),
    rtt=st.floats(0.1, 50),
)
def test_plans_are_contiguous_cover_all_layers_and_fit(nodes: list[Candidate], layers: int, rtt: float) -> None:
    model = ModelProfile(n_layers=layers, layer_bytes=GB // 4, first_bytes=GB // 2, last_bytes=GB // 2, layer_flops=1e8)
    ids = [c.node_id for c in nodes]
    opts = PlanOptions(max_stages=3)
    try:
        p = plan(model, nodes, rtts(ids, rtt), ids[0], opts)
    except NoChainFits as exc:
        assert exc.shortfall_bytes >= 0
        return
    by_id = {c.node_id: c for c in nodes}
    assert p.stages[0].layer_start == 0 and p.stages[-1].layer_end == layers
    for a, b in zip(p.stages, p.stages[1:], strict=False):
        assert a.layer_end == b.layer_start
    assert len({s.node_id for s in p.stages}) == len(p.stages)
    for s in p.stages:
        c = by_id[s.node_id]
        assert s.layer_end > s.layer_start
        assert not c.relay_only and c.role != "client"
        assert s.memory_bytes <= c.memory_bytes
    assert p.total_s == pytest.approx(p.compute_s + p.network_s + p.overhead_s)


def test_every_stage_pays_its_buffers_and_a_solo_stage_holds_a_tied_table_once() -> None:
    """Per-stage compute buffers count on every stage; a tied embedding/head table counts once when solo."""
    tied = ModelProfile(n_layers=4, layer_bytes=GB, first_bytes=2 * GB, last_bytes=2 * GB, layer_flops=1e8,
                        stage_bytes=GB, shared_bytes=2 * GB)
    assert tied.whole_bytes == 4 * GB + GB + 2 * GB  # layers, buffers, one table
    solo = plan(tied, [Candidate("a", 7 * GB, gflops=10)], {}, "a")
    assert solo.solo and solo.stages[0].memory_bytes == 7 * GB
    # split, each stage holds its own copy of the table and its own buffers
    nodes = [Candidate("a", 5 * GB, gflops=10), Candidate("b", 5 * GB, gflops=10)]
    split = plan(tied, nodes, rtts(["a", "b"], 1.0), "a")
    assert [(s.layer_start, s.layer_end) for s in split.stages] == [(0, 2), (2, 4)]
    assert [s.memory_bytes for s in split.stages] == [5 * GB, 5 * GB]
    with pytest.raises(NoChainFits):
        plan(tied, [Candidate("a", 4 * GB + GB // 2, gflops=10), Candidate("b", 4 * GB + GB // 2, gflops=10)],
             rtts(["a", "b"], 1.0), "a")


def test_overhead_is_paid_on_every_edge_of_the_ring() -> None:
    nodes = [Candidate(n, 64 * GB, gflops=50) for n in "abc"]
    p = plan(MODEL, nodes, rtts(list("abc"), 10.0), "a", PlanOptions(stages=3, per_hop_overhead_s=0.002))
    assert p.network_s == pytest.approx(0.015) and p.overhead_s == pytest.approx(0.006)


def test_a_measured_block_speed_prices_the_head_too() -> None:
    nodes = [Candidate("a", 64 * GB, seconds_per_layer=0.001)]
    p = plan(MODEL, nodes, {}, "a")
    assert p.compute_s == pytest.approx(24 * 0.001 + 0.001 * MODEL.head_flops / MODEL.layer_flops)


def test_speculation_amortises_the_ring_and_widens_with_distance() -> None:
    nodes = [Candidate(n, 64 * GB, seconds_per_layer=0.0005) for n in "abc"]
    ids = list("abc")

    def priced(rtt: float, acceptance: float) -> Plan:
        return plan(MODEL, nodes, rtts(ids, rtt), "a", PlanOptions(stages=3, speculation=Speculation(acceptance)))

    near, far = priced(2.0, 0.8), priced(80.0, 0.8)
    assert far.window > near.window >= 0
    assert far.speculative_s < far.total_s and far.tokens_per_pass > 2
    # pass(k) / E(k) at the chosen window, from the plan's own parts
    upstream = sum(s.compute_s for s in far.stages[:-1])
    e = far.tokens_per_pass
    assert far.speculative_s == pytest.approx(
        (far.network_s + far.overhead_s + upstream * (far.window + 1) + far.stages[-1].compute_s * e) / e)
    useless = priced(80.0, 0.0)
    assert useless.window == 0 and useless.speculative_s == pytest.approx(useless.total_s)


def test_with_speculation_a_distant_fast_node_can_pay_for_its_hops() -> None:
    """Plain decoding keeps the model on the slow node; a high acceptance makes the far fast one worth it."""
    nodes = [Candidate("slow", 64 * GB, seconds_per_layer=0.004), Candidate("fast", 64 * GB, seconds_per_layer=0.001)]
    matrix = rtts(["slow", "fast"], 120.0)
    assert plan(MODEL, nodes, matrix, "slow").solo
    chosen = plan(MODEL, nodes, matrix, "slow", PlanOptions(speculation=Speculation(0.95)))
    assert not chosen.solo and chosen.window > 4


def test_the_serving_nodes_own_time_per_token_is_added_once() -> None:
    nodes = [Candidate(n, 64 * GB, seconds_per_layer=0.0005) for n in "ab"]
    base = plan(MODEL, nodes, rtts(["a", "b"], 20.0), "a", PlanOptions(stages=2))
    served = plan(MODEL, nodes, rtts(["a", "b"], 20.0), "a", PlanOptions(stages=2, serve_overhead_s=0.004,
                                                                           speculation=Speculation(0.9)))
    assert served.total_s == pytest.approx(base.total_s + 0.004) and served.serve_s == 0.004
    assert served.speculative_s is not None and served.speculative_s > 0.004
