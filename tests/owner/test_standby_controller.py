"""The standby controller (sans-IO): when a standby starts serving a wanted model, and when it stops."""

from __future__ import annotations

from meshllm.mesh.demand import ModelDemand
from meshllm.owner.standby import Demote, Promote, StandbyConfig, StandbyController, Supply

T0 = 1_800_000_000.0
CONFIG = StandbyConfig(hold_s=2.0, stagger_s=4.0, idle_s=30.0, cooldown_s=60.0, queue_depth=1, active_s=30.0)


def wanted(now: float, requests: int = 10, unmet: int = 0, model: str = "m") -> dict[str, ModelDemand]:
    return {model: ModelDemand(model, requests, unmet, now - 0.5, ("client",))}


def run(ctl: StandbyController, start: float, seconds: float, demand: object, supply: dict[str, Supply],
        standbys: dict[str, list[str]] | None = None) -> list[tuple[float, object]]:
    """Step every half second; the actions with their times (promotions are taken as done at once)."""
    out = []
    t = start
    while t < start + seconds:
        d = demand(t) if callable(demand) else demand
        for action in ctl.step(t, d, supply, standbys or {ctl.node_id: list(ctl.candidates)}, {}, loading=False):
            out.append((t - start, action))
            if isinstance(action, Promote):
                ctl.promoted_now(action.model, t, action.reason)
        t += 0.5
    return out


def test_an_unserved_wanted_model_is_taken_after_the_hold_time_only() -> None:
    ctl = StandbyController("s1", ["m", "other"], CONFIG)
    actions = run(ctl, T0, 5.0, wanted, {})
    assert actions == [(2.0, Promote("m", "unserved"))]
    assert ctl.status(T0 + 5)["serving"] == ["m"] and ctl.decisions[-1]["reason"] == "unserved"


def test_a_short_spike_or_old_demand_does_nothing() -> None:
    ctl = StandbyController("s1", ["m"], CONFIG)
    blip = run(ctl, T0, 10.0, lambda t: wanted(t) if t < T0 + 1.5 else {}, {})
    stale = run(ctl, T0 + 31, 10.0, {"m": ModelDemand("m", 10, 0, T0, ("c",))}, {})  # last request > 30 s ago
    assert blip == [] and stale == []


def test_queue_at_the_servers_counts_only_without_free_slots() -> None:
    busy = StandbyController("s1", ["m"], CONFIG)
    assert run(busy, T0, 3.0, wanted, {"m": Supply(("a",), queue=2)}) == [(2.0, Promote("m", "queue"))]
    spare = StandbyController("s1", ["m"], CONFIG)
    assert run(spare, T0, 10.0, wanted, {"m": Supply(("a",), queue=2, free_slots=1)}) == []
    quiet = StandbyController("s1", ["m"], CONFIG)
    assert run(quiet, T0, 10.0, wanted, {"m": Supply(("a",), queue=0)}) == []


def test_only_new_refusals_count_for_the_servers_there_are_now() -> None:
    ctl = StandbyController("s1", ["m"], CONFIG)
    supply = {"m": Supply(("a",))}
    # refusals from before this set of servers (already in the minute's count at the first look) do not count
    assert run(ctl, T0, 10.0, lambda t: wanted(t, unmet=5), supply) == []
    rising = run(ctl, T0 + 10, 5.0, lambda t: wanted(t, unmet=6 + int(t - T0 - 10)), supply)
    assert rising == [(2.0, Promote("m", "refused"))]


def test_two_standbys_do_not_both_take_one_surge() -> None:
    """The mesh: a serves m and cannot keep up until a second server joins; s1 and s2 are standbys for m."""
    ctl = {n: StandbyController(n, ["m"], CONFIG) for n in ("s1", "s2")}
    standbys = {n: ["m"] for n in ctl}
    log: list[tuple[float, str, object]] = []
    t = T0
    while t < T0 + 60:
        servers = ("a", *sorted(n for n, c in ctl.items() if "m" in c.promoted))
        supply = {"m": Supply(servers, queue=3 if len(servers) < 2 else 0)}
        for name, c in ctl.items():
            for action in c.step(t, wanted(t), supply, standbys, {"m": t} if "m" in c.promoted else {}, False):
                log.append((round(t - T0, 1), name, action))
                if isinstance(action, Promote):
                    c.promoted_now("m", t, action.reason)
        t += 0.5
    first = min(ctl, key=lambda n: ctl[n].rank("m", standbys))
    assert log == [(2.0, first, Promote("m", "queue"))]  # the other waited its stagger; by then the need was gone


def test_the_second_standby_follows_when_the_need_persists() -> None:
    ctl = {n: StandbyController(n, ["m"], CONFIG) for n in ("s1", "s2")}
    standbys = {n: ["m"] for n in ctl}
    promoted_at = {}
    t = T0
    while t < T0 + 30:
        servers = ("a", *sorted(n for n, c in ctl.items() if "m" in c.promoted))
        supply = {"m": Supply(servers, queue=5)}  # the surge outgrows two servers too
        for name, c in ctl.items():
            for action in c.step(t, wanted(t), supply, standbys, {"m": t}, False):
                assert isinstance(action, Promote)
                c.promoted_now("m", t, action.reason)
                promoted_at[name] = t - T0
        t += 0.5
    first, second = sorted(promoted_at.values())
    assert first == 2.0 and second >= first + CONFIG.hold_s + CONFIG.stagger_s  # clock restarted at the change


def test_an_idle_promoted_model_is_unloaded_and_not_taken_again_during_the_cooldown() -> None:
    ctl = StandbyController("s1", ["m"], CONFIG)
    run(ctl, T0, 3.0, wanted, {})
    assert "m" in ctl.promoted
    used = {"m": T0 + 10}
    early = ctl.step(T0 + 10 + CONFIG.idle_s - 1, {}, {}, {"s1": ["m"]}, used, False)
    late = ctl.step(T0 + 10 + CONFIG.idle_s, {}, {}, {"s1": ["m"]}, used, False)
    assert early == [] and late == [Demote("m", CONFIG.idle_s)]
    assert ctl.step(T0 + 50, {}, {}, {}, used, loading=True) == []  # not while a load or unload runs
    ctl.demoted_now("m", T0 + 50, "idle")
    again = run(ctl, T0 + 51, CONFIG.cooldown_s - 2, wanted, {})
    assert again == [] and ctl.status(T0 + 60)["cooling"] == ["m"]
    assert run(ctl, T0 + 50 + CONFIG.cooldown_s, 3.0, wanted, {}) == [(0.0, Promote("m", "unserved"))]


def test_a_disabled_controller_promotes_nothing() -> None:
    ctl = StandbyController("s1", ["m"], CONFIG, enabled=False)
    assert run(ctl, T0, 10.0, wanted, {}) == []
    assert ctl.status(T0)["enabled"] is False


def test_models_served_here_already_or_outside_the_library_are_left_alone() -> None:
    ctl = StandbyController("s1", ["m"], CONFIG)
    assert run(ctl, T0, 10.0, wanted, {"m": Supply(("s1",), queue=9)}) == []
    assert run(ctl, T0, 10.0, lambda t: wanted(t, model="x"), {}) == []
