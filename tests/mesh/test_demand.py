"""The demand map core: one node's counts over a sliding window, and the merge over every origin."""

from __future__ import annotations

from meshllm.mesh.demand import (
    DEMAND_TTL_S,
    MAX_TRACKED,
    REPUBLISH_S,
    DemandTracker,
    mesh_demand,
    wanted_models,
    worth_publishing,
)
from meshllm.mesh.records import MAX_DEMAND, DemandEntry

T0 = 1_800_000_000.0


def test_requests_are_counted_over_the_window_and_forgotten_after_the_ttl() -> None:
    tracker = DemandTracker(window_s=60.0, ttl_s=600.0)
    for i in range(5):
        tracker.record("big", T0 + i)
    tracker.unmet("big", T0 + 4)
    tracker.record("other", T0 + 10)
    assert tracker.entries(T0 + 10) == [DemandEntry("other", 1, 0, T0 + 10), DemandEntry("big", 5, 1, T0 + 4)]
    # the window slides: big's requests leave it, its last request is still remembered until the TTL
    assert tracker.entries(T0 + 63) == [DemandEntry("other", 1, 0, T0 + 10), DemandEntry("big", 1, 1, T0 + 4)]
    assert tracker.entries(T0 + 100) == [DemandEntry("other", 0, 0, T0 + 10), DemandEntry("big", 0, 0, T0 + 4)]
    assert tracker.entries(T0 + 4 + 600.5) == [DemandEntry("other", 0, 0, T0 + 10)]
    assert tracker.entries(T0 + 10 + 601) == []


def test_unmet_never_exceeds_the_requests_and_needs_a_counted_request() -> None:
    tracker = DemandTracker()
    tracker.unmet("never-asked", T0)
    tracker.record("m", T0)
    for _ in range(3):
        tracker.unmet("m", T0 + 1)
    assert tracker.entries(T0 + 1) == [DemandEntry("m", 1, 1, T0)]


def test_the_tracker_and_its_record_entries_stay_bounded() -> None:
    """A client inventing model names cannot grow the table, nor the record past its cap."""
    tracker = DemandTracker()
    tracker.record("x" * 201, T0)  # longer than any record may name: not tracked
    for i in range(10 * MAX_TRACKED):
        tracker.record(f"m{i}", T0 + i * 0.001)
    assert len(tracker._models) == MAX_TRACKED
    entries = tracker.entries(T0 + 100)
    assert len(entries) == MAX_DEMAND and entries[0].model == f"m{10 * MAX_TRACKED - 1}"


def test_merge_adds_origins_keeps_the_latest_request_and_drops_expired_entries() -> None:
    merged = mesh_demand([
        ("a", [DemandEntry("m", 4, 1, T0 - 5), DemandEntry("old", 9, 9, T0 - DEMAND_TTL_S - 1)]),
        ("b", [DemandEntry("m", 2, 0, T0 - 1), DemandEntry("n", 1, 1, T0 + 30)]),  # b's clock runs ahead
        ("c", [DemandEntry("z", 1, 0, T0 + 3600)]),  # a clock far off: ignored
    ], T0)
    assert set(merged) == {"m", "n"}
    assert (merged["m"].requests, merged["m"].unmet, merged["m"].last_active, merged["m"].origins) == \
        (6, 1, T0 - 1, ("a", "b"))
    assert merged["n"].last_active == T0


def test_wanted_models_are_unserved_or_refused_and_recent() -> None:
    merged = mesh_demand([("a", [DemandEntry("served", 8, 0, T0 - 1), DemandEntry("full", 3, 2, T0 - 2),
                                 DemandEntry("missing", 5, 5, T0 - 3), DemandEntry("stale", 9, 9, T0 - 120),
                                 DemandEntry("quiet", 0, 0, T0 - 1)])], T0)
    assert wanted_models(merged, ["served", "full"], now=T0) == ["missing", "full"]


def test_a_record_is_re_signed_for_real_changes_and_only_now_and_then_for_drift() -> None:
    base = [DemandEntry("m", 20, 0, T0)]
    assert not worth_publishing(base, base, 100.0)
    assert worth_publishing(base, [*base, DemandEntry("n", 1, 0, T0)], 0.0)  # a model appears
    assert worth_publishing(base, [], 0.0)  # ... or goes
    assert worth_publishing(base, [DemandEntry("m", 20, 1, T0)], 0.0)  # a refusal
    assert worth_publishing(base, [DemandEntry("m", 26, 0, T0)], 0.0)  # a quarter more
    drift = [DemandEntry("m", 22, 0, T0 + 1)]
    assert not worth_publishing(base, drift, 2.0) and worth_publishing(base, drift, REPUBLISH_S)
