"""The coordinator core in memory with a passed clock: which steps go down the chain together and when,
a session leaving at any moment (its release waits for the pass holding its step), and deadlines."""

from __future__ import annotations

import pytest

from meshllm.engine.speculate import ChainCosts, NgramDrafter, WindowPolicy
from meshllm.split.coordinator_core import GATHER_S, Deadlines, PassSchedule, Ready, answers, next_draft, smoothed
from meshllm.split.frames import Tokens


def ready(session: str, pos: int = 5, draft: list[int] | None = None) -> Ready[str]:
    return Ready(session, [1, *(draft or [])], pos, draft or [])


def sessions(passes: list) -> list[list[str]]:  # type: ignore[type-arg]
    return [[r.session for r in p.steps] for p in passes]


def test_a_lone_session_goes_at_once() -> None:
    plan: PassSchedule[str] = PassSchedule(stages=2, batch=8, max_wait=1.0)
    (p,) = plan.queue(ready("a"), now=0.0)
    assert sessions([p]) == [["a"]] and plan.wake_at is None and plan.sending == {"a": p.id}


def test_sessions_ready_together_share_a_pass_up_to_the_batch() -> None:
    plan: PassSchedule[str] = PassSchedule(stages=1, batch=3, max_wait=1.0)
    plan.decoding |= {"a", "b", "c", "d"}  # all past their prefill
    out = []
    for sid in "abcd":
        out += plan.queue(ready(sid), now=0.0)
    assert sessions(out) == [["a", "b", "c"]] and plan.wake_at is None  # d gathers behind that pass
    assert plan.sent(out[0], ["a", "b", "c"], 3) == 3 and plan.finished(out[0], now=0.001) == []
    assert plan.wake_at == pytest.approx(0.001 + GATHER_S)  # once it is on its way, d waits briefly
    assert sessions(plan.wake(0.001 + GATHER_S)) == [["d"]]  # the gather ended: whoever is ready goes


def test_decoding_sessions_spread_over_one_pass_per_stage() -> None:
    plan: PassSchedule[str] = PassSchedule(stages=2, batch=8, max_wait=1.0)
    plan.decoding |= {"a", "b", "c", "d"}
    out = []
    for sid in "abcd":
        out += plan.queue(ready(sid), now=0.0)
    assert sessions(out) == [["a", "b"], ["c", "d"]]  # while stage 1 computes one, the coordinator the other


def test_a_session_ready_while_every_stage_is_busy_waits_to_merge_but_never_past_the_limit() -> None:
    plan: PassSchedule[str] = PassSchedule(stages=2, batch=8, max_wait=0.05, step_s=0.01)
    for sid in "ab":
        (p,) = plan.queue(ready(sid), now=0.0)
        plan.sent(p, [sid], 1)
        plan.finished(p, now=0.0)
    assert plan.queue(ready("c"), now=1.0) == [] and plan.wake_at == pytest.approx(1.02)  # about two passes
    plan.step_s = 1.0
    assert plan.returned("x", now=1.0) == [] and plan.wake_at == pytest.approx(1.02)  # never postponed
    plan.wake_at = None
    plan.returned("x", now=2.0)
    assert plan.wake_at == pytest.approx(2.05)  # a slow chain still waits at most max_wait
    assert plan.returned("a", now=2.01) == []  # a's client reads its tokens: a is about to be ready
    assert sessions(plan.queue(ready("a", pos=6), now=2.011)) == [["c", "a"]]  # and merges with c


def test_steps_ready_while_the_first_stage_computes_gather_behind_its_pass() -> None:
    # a chain whose first stage is its heavy one ([0, 29) + [29, 30)): a pass that is not full would
    # only queue behind the one the coordinator computes, so the sessions returning meanwhile gather
    # (no lone pass, no timer) and go together; a full pass has nobody to wait for and queues
    plan: PassSchedule[str] = PassSchedule(stages=2, batch=8, max_wait=1.0, step_s=0.05)
    plan.decoding |= {"a", "b", "c", "d"}
    (p1,) = plan.queue(ready("a"), now=0.0) + plan.queue(ready("b"), now=0.0)
    assert plan.computing == p1.id
    assert plan.queue(ready("c"), now=0.001) == [] and plan.wake_at is None
    (p2,) = plan.queue(ready("d"), now=0.002)
    assert sessions([p1, p2]) == [["a", "b"], ["c", "d"]] and plan.computing == p2.id
    assert plan.computed(p1, now=0.01) == []
    plan.sent(p1, ["a", "b"], 2)
    plan.finished(p1, now=0.01)
    plan.returned("a", now=0.02)
    assert plan.queue(ready("a", pos=6), now=0.02) == [] and plan.wake_at is None  # p2 still computes
    assert plan.computed(p2, now=0.025) == []  # b's client still reads its token, p2 is on its way:
    assert plan.wake_at == pytest.approx(0.125)  # every stage has a pass, so about two passes at most
    plan.returned("b", now=0.03)
    assert sessions(plan.queue(ready("b", pos=6), now=0.03)) == [["a", "b"]]


def test_rows_ahead_count_the_passes_still_in_flight() -> None:
    plan: PassSchedule[str] = PassSchedule(stages=3, batch=8, max_wait=1.0)
    (p1,) = plan.queue(ready("a", draft=[4, 5]), now=0.0)
    assert plan.sent(p1, ["a"], 3) == 3 and plan.finished(p1, now=0.0) == []
    (p2,) = plan.queue(ready("b"), now=0.0)
    assert plan.sent(p2, ["b"], 1) == 4 and plan.finished(p2, now=0.0) == []  # a's window goes first everywhere
    plan.returned("a", now=0.1)
    (p3,) = plan.queue(ready("c"), now=0.1)
    assert plan.sent(p3, ["c"], 1) == 2 and (plan.passes, plan.steps) == (3, 3)


@pytest.mark.parametrize("moment", ["queued", "sending", "in flight", "returned"])
def test_a_session_leaving_at_any_moment_leaves_at_once_and_waits_only_for_its_own_pass(moment: str) -> None:
    plan: PassSchedule[str] = PassSchedule(stages=1, batch=8, max_wait=1.0)
    plan.decoding |= {"a", "b"}
    plan.queue(ready("a"), now=0.0)
    passes = [] if moment == "queued" else plan.queue(ready("b"), now=0.0)  # both go as one pass
    if moment in ("in flight", "returned"):
        plan.sent(passes[0], ["a", "b"], 2)
        plan.finished(passes[0], now=0.0)
    if moment == "returned":
        plan.returned("a", now=0.1)
    launched, wait_for = plan.leave("a", now=0.2)
    assert wait_for == (passes[0].id if moment == "sending" else None)  # its Stop must not overtake that pass
    assert "a" not in plan.decoding and "a" not in plan.in_flight and all(r.session != "a" for r in plan.ready)
    if moment == "queued":  # its waiting step is dropped, and with it the gather's wake-up
        assert launched == [] and plan.ready == [] and plan.wake_at is None
    if moment == "sending":
        plan.finished(passes[0], now=0.2)
        assert plan.leave("a", now=0.3)[1] is None


def test_a_batch_behind_a_leaving_session_goes_without_it() -> None:
    plan: PassSchedule[str] = PassSchedule(stages=1, batch=8, max_wait=1.0)
    plan.decoding |= {"a", "b", "c"}
    plan.queue(ready("a"), now=0.0)
    plan.queue(ready("b"), now=0.0)
    launched, _ = plan.leave("c", now=0.0)  # c will never be ready: nobody waits for it
    assert sessions(launched) == [["a", "b"]]


def test_deadlines_are_data() -> None:
    d = Deadlines(decode_timeout=1.0, prefill_s_per_token=0.01, soft_factor=8.0, soft_min=0.2)
    assert d.prefill(100, ahead=50) == pytest.approx(2.5)
    assert d.prefill(100, ahead=-5) == pytest.approx(2.0)
    assert d.step(0.0, 1, rows=1, ahead=0) == (1.0, 1.0)  # no step measured yet: no early check
    timeout, check = d.step(0.01, 3, rows=4, ahead=10)  # 3 rows ahead in passes, 10 prompt tokens
    assert timeout == pytest.approx(1.13) and check == pytest.approx(0.24 + 0.13)
    assert d.step(0.001, 1, rows=1, ahead=0)[1] == pytest.approx(0.2)  # the floor
    assert smoothed(0.0, 0.5) == 0.5 and smoothed(1.0, 0.5) == pytest.approx(0.9)


def test_replies_answer_only_their_step() -> None:
    assert answers(Tokens(session="s", pos=6, token_ids=[1]), start=5, end=6)
    assert answers(Tokens(session="s", pos=7, token_ids=[1, 2]), start=5, end=8)  # a window kept one draft
    assert not answers(Tokens(session="s", pos=5, token_ids=[1]), start=5, end=6)  # the previous step's
    assert not answers(Tokens(session="s", pos=9, token_ids=[1]), start=8, end=8)


def test_a_window_is_drafted_only_with_room_and_measured_costs() -> None:
    drafter = NgramDrafter([1, 2, 3, 4, 1, 2, 3])
    costs = ChainCosts()
    policy = WindowPolicy("on")
    assert next_draft(drafter, policy, costs, room=8) == []  # costs not measured yet
    costs.observe(0.01, 1, 1, 0.001, 0.001)
    assert next_draft(drafter, policy, costs, room=0) == []
    assert next_draft(drafter, policy, costs, room=8)[:1] == [4]
    assert len(next_draft(drafter, policy, costs, room=1)) <= 1
