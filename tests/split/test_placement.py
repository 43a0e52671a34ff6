"""Placement's pure parts: gossip -> planner inputs, stage counts (the control protocol: test_control.py)."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest

from meshllm.mesh.records import Addresses, Capacity, PeerRecord
from meshllm.split import Candidate, ModelProfile, Plan, PlanOptions, plan
from meshllm.split.frames import Hop
from meshllm.split.placement import (
    SPARE_SLACK,
    NotEnoughWorkers,
    SplitOptions,
    candidates,
    choose_plan,
    covered_deaths,
    describe,
    memory_budget,
    model_profile,
    needs_split,
    node_budget,
    plan_options,
    spare_ranges,
)
from meshllm.split.planner import Held, plan_held
from meshllm.split.service import offered_capacity

GB = 1 << 30


def record(node: str, role: str, ram: int = 8 * GB, listen: tuple[str, ...] = ("127.0.0.1:1",)) -> PeerRecord:
    return PeerRecord(node_id=node, mesh_id="m", seq=1, membership_proof=b"p", role=role,  # type: ignore[arg-type]
                      capacity=Capacity(ram_bytes=ram, gflops=10.0), addresses=Addresses(listen=list(listen)))


def test_only_direct_workers_are_candidates() -> None:
    own = record("me", "host")
    members = {"w1": record("w1", "worker"), "h": record("h", "host"), "c": record("c", "client"),
               "relay": record("relay", "worker", listen=()), "sus": record("sus", "worker")}
    found = candidates(own, 2 * GB, members, exclude={"sus"})
    assert [(c.node_id, c.memory_bytes) for c in found if not c.relay_only] == [("me", 2 * GB), ("w1", 8 * GB)]
    assert [c.node_id for c in found if c.relay_only] == ["relay"]


def test_a_coordinators_memory_cap_never_shrinks_a_worker() -> None:
    """``serve --max-memory`` is this node's budget only: a worker offers what its own record says
    (its own ``--max-memory``, else its RAM), so a model that fits the mesh is planned onto it."""
    profile = ModelProfile(n_layers=8, layer_bytes=GB, first_bytes=GB // 2, last_bytes=GB // 2, layer_flops=1e8)
    cap = 2 * GB
    options = SplitOptions(mode="auto", max_memory=cap)
    own = record("me", "host", ram=64 * GB)
    members = {"w": record("w", "worker", ram=16 * GB)}
    nodes = candidates(own, memory_budget(own.capacity, options.max_memory), members)
    assert [(c.node_id, c.memory_bytes) for c in nodes] == [("me", cap), ("w", 16 * GB)]
    chosen = plan(profile, nodes, {}, "me", plan_options(options, len(nodes) - 1))
    assert chosen.stages[0].node_id == "me" and chosen.stages[0].memory_bytes <= cap
    assert chosen.chain[1][0] == "w" and chosen.stages[1].memory_bytes > cap  # 7 of the 8 layers: 7.5 GiB
    assert chosen.chain == [("me", 0, 1), ("w", 1, 8)]
    said = describe(chosen, {"me": "coord", "w": "worker1"}, "m", profile, nodes=nodes, max_memory=cap)["nodes"]
    assert [(n["name"], n["memory_bytes"]) for n in said] == [("coord", cap), ("worker1", 16 * GB)]
    assert "--max-memory (2.00 GiB)" in said[0]["memory"] and "offered by the worker" in said[1]["memory"]


def test_a_worker_caps_only_what_it_offers() -> None:
    """A worker's record offers its stage RAM: its ``--max-memory`` (never more than it has), else 75 % of its
    RAM; a host's record is left as measured (its cap is its own budget, applied where it plans)."""
    measured = Capacity(ram_bytes=32 * GB, vram_bytes=GB, gflops=10.0)
    assert offered_capacity(measured, "worker", 4 * GB) == Capacity(ram_bytes=4 * GB, vram_bytes=GB, gflops=10.0)
    assert offered_capacity(measured, "worker", 64 * GB) == measured
    assert offered_capacity(measured, "host", 4 * GB) == measured
    assert offered_capacity(measured, "worker", None) == Capacity(ram_bytes=24 * GB, vram_bytes=GB, gflops=10.0)


@pytest.mark.parametrize(("cap", "expected"), [(None, 24 * GB + GB), (4 * GB, 5 * GB), (64 * GB, 33 * GB)])
def test_what_the_planner_assumes_of_a_worker_is_what_it_accepts(cap: int | None, expected: int) -> None:
    """One number: the memory a coordinator's candidate list gives a worker (from its gossiped record) equals
    the budget the worker's own stage host enforces (``node_budget`` of the same record, which SplitService
    hands its StageHost), with and without the worker's ``--max-memory``."""
    measured = Capacity(ram_bytes=32 * GB, vram_bytes=GB, gflops=10.0)
    worker = msgspec.structs.replace(record("w", "worker"), capacity=offered_capacity(measured, "worker", cap))
    own = record("me", "host")
    planned = {c.node_id: c.memory_bytes for c in candidates(own, GB, {"w": worker})}["w"]
    assert planned == node_budget(worker, cap) == expected
    # a coordinator's own budget is still its --max-memory (else 75 % of its RAM) plus free VRAM
    assert node_budget(own, None) == memory_budget(own.capacity, None) == 6 * GB
    assert node_budget(own, 2 * GB) == 2 * GB


def test_forced_stages_wait_for_workers_then_degrade_after_a_failure() -> None:
    opts = SplitOptions(mode="force", stages=3)
    with pytest.raises(NotEnoughWorkers):
        plan_options(opts, 1, placing=True)
    assert plan_options(opts, 2, placing=True).stages == 3
    assert plan_options(opts, 1, placing=True, degraded=True).stages == 2
    with pytest.raises(NotEnoughWorkers):
        plan_options(opts, 0, placing=True, degraded=True)
    assert plan_options(SplitOptions(mode="auto"), 0).stages is None


def test_auto_splits_only_what_does_not_fit(tiny_model: Path) -> None:
    profile = model_profile(tiny_model, 256)
    assert profile.n_layers == 6 and profile.layer_bytes > 0 and profile.first_bytes > 0 and profile.stage_bytes > 0
    whole = 6 * profile.layer_bytes + profile.first_bytes + profile.last_bytes + profile.stage_bytes
    assert profile.whole_bytes == whole
    assert not needs_split(SplitOptions(mode="auto"), profile, whole)
    assert needs_split(SplitOptions(mode="auto"), profile, whole - 1)
    assert needs_split(SplitOptions(mode="force"), profile, 100 * GB)
    assert not needs_split(SplitOptions(mode="off"), profile, 1)


def test_spare_ranges_cover_the_rebuild_after_each_death() -> None:
    """Three stages over a coordinator and two workers, then a third worker: what each worker keeps on disk
    is exactly what the degraded plan after any one death gives it and it does not hold (with slack)."""
    profile = ModelProfile(n_layers=18, layer_bytes=GB // 8, first_bytes=GB // 4, last_bytes=GB // 4,
                           layer_flops=2e8, head_flops=4e8)
    opts = SplitOptions(mode="force", stages=3)
    nodes = [Candidate(n, 8 * GB, gflops=10, role="host" if n == "me" else "worker") for n in ("me", "w1", "w2")]
    chosen = plan(profile, nodes, {}, "me", plan_options(opts, 2, placing=True))
    chain = [Hop(s.node_id, "127.0.0.1:1", s.layer_start, s.layer_end) for s in chosen.stages]
    spares = spare_ranges(profile, nodes, {}, chain, opts)
    for dead in chain[1:]:
        rest = [c for c in nodes if c.node_id != dead.node_id]
        rebuilt = plan(profile, rest, {}, "me", plan_options(opts, len(rest) - 1, placing=True, degraded=True))
        for stage in rebuilt.stages[1:]:
            held = next((h for h in chain if h.node_id == stage.node_id), None)
            kept = spares.get(stage.node_id)
            assert (held is not None and held.layer_start <= stage.layer_start and stage.layer_end <= held.layer_end) \
                or (kept is not None and kept[0] <= max(1, stage.layer_start - SPARE_SLACK)
                    and min(18, stage.layer_end + SPARE_SLACK) <= kept[1])
    assert spares and all(1 <= a < b <= 18 for a, b in spares.values())
    # a worker outside the chain is the spare when it is the one a rebuild would place
    nodes.append(Candidate("w3", 8 * GB, gflops=10, role="worker"))
    spares = spare_ranges(profile, nodes, {}, chain, opts)
    assert "w3" in spares
    # one worker: its death leaves no chain, so there is nothing to keep warm
    assert spare_ranges(profile, nodes[:2], {}, chain[:2], SplitOptions(mode="force", stages=2)) == {}


def inside(chosen: Plan, held: Held) -> bool:
    """Whether every worker stage of ``chosen`` lies inside a range its node keeps on disk."""
    return all(any(a <= s.layer_start and s.layer_end <= b for a, b in held.get(s.node_id, ()))
               for s in chosen.stages[1:])


def three_stage_chain(profile: ModelProfile, nodes: list[Candidate], opts: SplitOptions) -> list[Hop]:
    return [Hop(s.node_id, "127.0.0.1:1", s.layer_start, s.layer_end)
            for s in plan(profile, nodes, {}, "me", plan_options(opts, len(nodes) - 1, placing=True)).stages]


def test_a_rebuild_on_measured_speeds_stays_inside_the_warm_ranges() -> None:
    """The rebuild after a death is priced with the speeds the chain measured, which can move a boundary
    past a spare's slack (here: the coordinator far slower than the survivor); :func:`plan_held` then
    finds the best chain inside what the nodes keep on disk, and the death is reported covered."""
    profile = ModelProfile(n_layers=18, layer_bytes=GB // 8, first_bytes=GB // 4, last_bytes=GB // 4,
                           layer_flops=2e8, head_flops=4e8)
    opts = SplitOptions(mode="force", stages=3)
    nodes = [Candidate(n, 8 * GB, gflops=10, role="host" if n == "me" else "worker") for n in ("me", "w1", "w2")]
    chain = three_stage_chain(profile, nodes, opts)
    held: dict[str, set[tuple[int, int]]] = {h.node_id: {(h.layer_start, h.layer_end)} for h in chain[1:]}
    # nothing warm yet: w1's death is covered all the same (the coordinator takes its layers, w2 keeps its
    # own), w2's is not (w1 holds no range that ends at the head)
    assert [(h.layer_start, h.layer_end) for h in chain] == [(0, 16), (16, 17), (17, 18)]
    assert covered_deaths(profile, nodes, {}, chain, opts, held) == ["w1"]
    for node, kept in spare_ranges(profile, nodes, {}, chain, opts).items():
        held.setdefault(node, set()).add(kept)
    assert covered_deaths(profile, nodes, {}, chain, opts, held) == [h.node_id for h in chain[1:]]
    dead = chain[-1].node_id
    rest = [c for c in nodes if c.node_id != dead]
    degraded = plan_options(opts, 1, placing=True, degraded=True)
    per_layer = 1e-3
    measured = [Candidate(c.node_id, c.memory_bytes, role=c.role,
                          seconds_per_layer=per_layer * (8 if c.node_id == "me" else 1)) for c in rest]
    moved = plan(profile, measured, {}, "me", degraded)
    assert not inside(moved, held)  # the free plan would fetch
    kept = plan_held(profile, measured, {}, "me", held, degraded)
    assert kept is not None and inside(kept, held) and len(kept.stages) == 2
    assert kept.stages[1].layer_start < plan(profile, rest, {}, "me", degraded).stages[1].layer_start  # still balanced
    assert plan_held(profile, measured, {}, "me", {}, degraded) is None  # nothing on disk: no such chain


def test_a_rebuild_whose_survivors_swap_order_stays_inside_the_warm_ranges() -> None:
    """The case that made tests/node/test_failover_split.py fetch in 2 runs of 5: 6 layers, 3 stages and a
    spare (w3). The spares were warmed on the speeds gossip gave at the spare check (w3 fastest: the
    degraded chain after w2's death is ``me -> w1 -> w3``, w3 with the long range); by the death the
    speeds had changed, both those the chain measured and those gossip re-measured (the coordinator now
    fastest), so every free replan orders the survivors ``me -> w1 -> w3`` with w1 on layer 4, which it
    holds nowhere (its hosted [5, 6) and warm [1, 4)). The rebuild must take the chain inside the held
    ranges, and w2's death must be reported covered beforehand."""
    profile = ModelProfile(n_layers=6, layer_bytes=1 << 20, first_bytes=1 << 20, last_bytes=1 << 20,
                           layer_flops=2e8, head_flops=4e8)
    opts = SplitOptions(mode="force", stages=3)

    def nodes(**gflops: float) -> list[Candidate]:
        return [Candidate(n, 8 * GB, gflops=g, role="host" if n == "me" else "worker") for n, g in gflops.items()]

    chain = three_stage_chain(profile, nodes(me=12, w1=10, w2=9), opts)
    assert [(h.node_id, h.layer_start, h.layer_end) for h in chain] == [("me", 0, 4), ("w2", 4, 5), ("w1", 5, 6)]
    held: dict[str, set[tuple[int, int]]] = {h.node_id: {(h.layer_start, h.layer_end)} for h in chain[1:]}
    at_check = nodes(me=12, w1=10, w2=9, w3=13)  # w3 joined, and measured itself fastest
    spares = spare_ranges(profile, at_check, {}, chain, opts)
    assert spares == {"w1": (1, 4), "w2": (1, 4), "w3": (1, 6)}  # what the failing run's event showed
    for node, kept in spares.items():
        held.setdefault(node, set()).add(kept)
    assert covered_deaths(profile, at_check, {}, chain, opts, held) == ["w2", "w1"]
    degraded = plan_options(opts, 2, placing=True, degraded=True)
    gossip = nodes(me=14, w1=10, w3=13)  # w2 dead; gossip now has the coordinator fastest
    measured = [Candidate(c.node_id, c.memory_bytes, role=c.role, seconds_per_layer=s)
                for c, s in zip(gossip, (1e-3, 3e-3, 2e-3), strict=True)]
    for speeds in (gossip, measured):
        free = plan(profile, speeds, {}, "me", degraded)
        assert free.chain == [("me", 0, 4), ("w1", 4, 5), ("w3", 5, 6)] and not inside(free, held)
        kept = choose_plan(profile, speeds, {}, "me", held, degraded)
        assert inside(kept, held) and len(kept.stages) == 3, kept
        assert kept.chain[0][2] >= 3  # still balanced: the fast coordinator keeps the most layers
    # with nothing on disk the placement takes the free plan (and fetches)
    assert choose_plan(profile, gossip, {}, "me", {}, degraded) == plan(profile, gossip, {}, "me", degraded)


def test_held_plans_respect_memory_and_the_forced_stage_count() -> None:
    """A held range is no licence to overfill a node, and a chain of the forced length that fits inside
    the held ranges is the only one taken (none: None, and the rebuild fetches)."""
    profile = ModelProfile(n_layers=8, layer_bytes=GB, first_bytes=GB // 4, last_bytes=GB // 4, layer_flops=2e8)
    opts = PlanOptions(stages=3)
    roomy = [Candidate("me", 2 * GB, gflops=10), Candidate("w1", 64 * GB, gflops=10, role="worker"),
             Candidate("w2", 64 * GB, gflops=10, role="worker")]
    kept = plan_held(profile, roomy, {}, "me", {"w1": [(1, 5)], "w2": [(4, 8)]}, opts)
    assert kept is not None and kept.chain[0] == ("me", 0, 1) and inside(kept, {"w1": [(1, 5)], "w2": [(4, 8)]})
    assert plan_held(profile, roomy, {}, "me", {"w1": [(1, 3)], "w2": [(4, 8)]}, opts) is None  # layer 3: nobody
    tight = [roomy[0], Candidate("w1", 2 * GB, gflops=10, role="worker"), roomy[2]]
    assert plan_held(profile, tight, {}, "me", {"w1": [(1, 5)], "w2": [(5, 8)]}, opts) is None  # w1 holds 1 layer
    assert plan_held(profile, roomy, {}, "me", {"w1": [(1, 8)]}, opts) is None  # 3 stages need 2 held workers
