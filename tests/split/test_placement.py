"""Placement's pure parts: gossip -> planner inputs, stage counts (the control protocol: test_control.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from meshllm.mesh.records import Addresses, Capacity, PeerRecord
from meshllm.split.placement import (
    NotEnoughWorkers,
    SplitOptions,
    candidates,
    model_profile,
    needs_split,
    plan_options,
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
