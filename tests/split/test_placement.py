"""Placement's pure parts: gossip -> planner inputs, stage counts (the control protocol: test_control.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from meshllm.mesh.records import Addresses, Capacity, PeerRecord
from meshllm.split import Candidate, ModelProfile, plan
from meshllm.split.frames import Hop
from meshllm.split.placement import (
    SPARE_SLACK,
    NotEnoughWorkers,
    SplitOptions,
    candidates,
    covers,
    model_profile,
    needs_split,
    plan_options,
    spare_ranges,
)

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


def test_a_replan_on_measured_speeds_may_leave_the_spares_then_their_own_plan_covers_it() -> None:
    """Why a replan checks :func:`covers`: spares are planned on gossiped speeds; the rebuild after a death
    priced with the speeds the chain measured (here the coordinator far slower than the survivor) moves the
    boundary past the spare's slack, while the spares' own plan lies inside what the nodes hold."""
    profile = ModelProfile(n_layers=18, layer_bytes=GB // 8, first_bytes=GB // 4, last_bytes=GB // 4,
                           layer_flops=2e8, head_flops=4e8)
    opts = SplitOptions(mode="force", stages=3)
    nodes = [Candidate(n, 8 * GB, gflops=10, role="host" if n == "me" else "worker") for n in ("me", "w1", "w2")]
    chain = [Hop(s.node_id, "127.0.0.1:1", s.layer_start, s.layer_end)
             for s in plan(profile, nodes, {}, "me", plan_options(opts, 2, placing=True)).stages]
    held = {h.node_id: {(h.layer_start, h.layer_end)} for h in chain[1:]}
    for node, kept in spare_ranges(profile, nodes, {}, chain, opts).items():
        held.setdefault(node, set()).add(kept)
    dead = chain[-1].node_id
    rest = [c for c in nodes if c.node_id != dead]
    degraded = plan_options(opts, 1, placing=True, degraded=True)
    steady = plan(profile, rest, {}, "me", degraded)
    assert covers(steady, held)
    per_layer = 1e-3
    measured = [Candidate(c.node_id, c.memory_bytes, role=c.role,
                          seconds_per_layer=per_layer * (8 if c.node_id == "me" else 1)) for c in rest]
    moved = plan(profile, measured, {}, "me", degraded)
    assert moved.stages[1].layer_start != steady.stages[1].layer_start
    assert not covers(moved, held)
    assert not covers(steady, {})  # nothing on disk: every worker stage needs its bytes
