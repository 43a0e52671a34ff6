"""The slot scheduler without llama.cpp: assignment, prompt-cache reuse on the grid, fairness, step plans."""

from __future__ import annotations

import pytest

from meshllm.engine.fair_queue import QueueFull
from meshllm.engine.slots import CallCosts, Chunk, DecodeRow, Scheduler

C = 4  # chunk


def sched(slots: int = 2, max_queue: int = 8) -> Scheduler[str]:
    return Scheduler(slots, chunk=C, max_queue=max_queue)


def run_prefill(s: Scheduler[str]) -> None:
    """Prefill every assigned prompt to its end and give each slot a first sampled token."""
    while True:
        step = s.plan()
        if not step.prefill:
            return
        for chunk in step.prefill:
            s.prefilled(chunk)
            if chunk.last:
                s.sampled(chunk.slot, 100 + chunk.slot)


def test_prefill_runs_on_the_grid_with_one_chunk_of_work_per_step() -> None:
    s = sched(slots=3)
    s.submit("a", tuple(range(10)), "x", 0.0)
    s.submit("b", tuple(range(3)), "y", 0.0)
    step = s.plan()
    assert [(a.job, a.slot, a.reused) for a in step.assigned] == [("a", 0, 0), ("b", 1, 0)]
    assert step.prefill == [Chunk(0, 0, (0, 1, 2, 3), False)]  # b waits: the budget is one chunk
    s.prefilled(step.prefill[0])
    step = s.plan()
    assert step.prefill == [Chunk(1, 0, (0, 1, 2), True)]  # prefilling slots take turns
    s.prefilled(step.prefill[0])
    s.sampled(1, 7)
    step = s.plan()
    assert step.decode == [DecodeRow(1, 7, 3)]
    assert step.prefill == [Chunk(0, 4, (4, 5, 6, 7), False)]


def test_small_chunks_share_a_step() -> None:
    s = sched(slots=3)
    for job in "abc":
        s.submit(job, (1,), job, 0.0)
    step = s.plan()
    assert [c.slot for c in step.prefill] == [0, 1, 2] and all(c.last for c in step.prefill)


def test_a_slot_lends_whole_grid_chunks_of_its_prompt_and_never_the_last_token() -> None:
    s = sched(slots=2)
    prompt = tuple(range(10))
    s.submit("a", prompt, "x", 0.0)
    run_prefill(s)
    s.decoded(0)
    s.release(0)
    assert s.slots[0].cached == [*prompt, 100] and s.slots[0].exact == 8  # [8, 10) was a partial chunk
    s.submit("b", (*prompt, 5, 5), "x", 0.0)
    assert s.plan().assigned[0].reused == 8
    s.release(0)
    s.submit("c", prompt[:8], "x", 0.0)  # all of c is cached, but its last token must be computed
    assignment = s.plan().assigned[0]
    assert (assignment.slot, assignment.reused) == (0, 4)


def test_decoded_tokens_are_never_lent() -> None:
    s = sched(slots=1)
    s.submit("a", (1, 2, 3, 4), "x", 0.0)
    run_prefill(s)
    for _ in range(8):
        s.decoded(0)
        s.sampled(0, 9)
    s.release(0)
    assert s.slots[0].exact == 4
    s.submit("b", (1, 2, 3, 4, 100, 9, 9, 9, 9, 9), "x", 0.0)
    assert s.plan().assigned[0].reused == 4


def test_the_slot_with_the_longest_reusable_prefix_wins_else_an_empty_or_the_oldest() -> None:
    s = sched(slots=3)
    s.submit("a", tuple(range(9)), "x", 0.0)
    s.submit("b", tuple(range(50, 59)), "x", 0.0)
    run_prefill(s)
    s.release(0)
    s.release(1)
    s.submit("c", tuple(range(50, 60)), "x", 0.0)
    assert (s.plan().assigned[0].slot, s.slots[1].job) == (1, "c")
    s.submit("d", (7, 7, 7), "x", 0.0)
    assert s.plan().assigned[0].slot == 2  # empty slot before evicting a's cache
    run_prefill(s)
    s.release(2)
    s.submit("e", (8, 8, 8), "x", 0.0)
    assert s.plan().assigned[0].slot == 0  # a's cache is the oldest released


def test_clients_take_turns() -> None:
    s = sched(slots=1)
    for i in range(3):
        s.submit(f"flood{i}", (1,), "greedy", float(i))
    s.submit("polite", (1,), "polite", 5.0)
    order = [s.plan().assigned[0].job]
    s.submit("late", (1,), "late", 6.0)
    for _ in range(4):
        s.release(0)
        order.append(s.plan().assigned[0].job)
    assert order == ["flood0", "polite", "late", "flood1", "flood2"]


def test_the_client_holding_fewest_slots_goes_first() -> None:
    s = sched(slots=3)
    s.submit("a0", (1,), "a", 0.0)
    s.submit("a1", (1,), "a", 0.0)
    s.plan()
    s.submit("a2", (1,), "a", 1.0)
    s.submit("b0", (1,), "b", 2.0)
    assert [x.job for x in s.plan().assigned] == ["b0"]


def test_a_full_queue_makes_room_for_a_client_below_its_share() -> None:
    s = sched(slots=1, max_queue=4)
    s.submit("running", (1,), "a", 0.0)
    s.plan()
    for i in range(4):
        s.submit(f"a{i}", (1,), "a", 0.0)
    with pytest.raises(QueueFull, match="already has 4"):
        s.submit("a4", (1,), "a", 0.0)
    assert s.submit("b0", (1,), "b", 0.0) == ["a3"]  # the flooding client's newest gives way
    assert s.submit("b1", (1,), "b", 0.0) == ["a2"]
    with pytest.raises(QueueFull, match="already has 2"):
        s.submit("b2", (1,), "b", 0.0)  # a share of 4 places between two clients: 2 each
    assert s.submit("c0", (1,), "c", 0.0) == ["b1"]  # a and b hold 2 each: the newest of theirs goes
    assert s.submit("d0", (1,), "d", 0.0) == ["a1"]
    with pytest.raises(QueueFull, match="4 requests are waiting"):
        s.submit("e0", (1,), "e", 0.0)  # everyone holds one place: nobody is over their share
    assert s.queued == 4


def test_expired_and_cancelled_requests_leave() -> None:
    s = sched(slots=1)
    s.submit("running", (1, 2), "a", 0.0)
    s.plan()
    s.submit("old", (1,), "a", 0.0)
    s.submit("new", (1,), "a", 9.0)
    assert s.expired(10.0, 5.0) == ["old"] and s.queued == 1
    assert s.cancel("new") is None and s.queued == 0
    assert s.cancel("running") == 0 and s.running == 0 and s.idle
    assert s.slots[0].cached == []  # cancelled before any chunk ran


def test_forget_drops_a_slots_cache() -> None:
    s = sched(slots=1)
    s.submit("a", tuple(range(8)), "x", 0.0)
    run_prefill(s)
    s.forget(0)
    s.release(0)
    s.submit("b", tuple(range(9)), "x", 0.0)
    assert s.plan().assigned[0].reused == 0


def test_call_costs_split_a_batch_only_when_single_rows_are_measured_faster() -> None:
    costs = CallCosts(reprobe=3)
    assert not costs.split(2)  # nothing measured: batch, and measure it
    costs.observe(1, 0.018)
    costs.observe(2, 0.048)
    costs.observe(8, 0.090)
    assert costs.split(2) and costs.split(2)
    assert not costs.split(2)  # every third time the batch is measured again
    assert not costs.split(8)  # 8 x 18 ms > 90 ms
    for _ in range(30):
        costs.observe(2, 0.030)  # the batch got cheaper
    assert not costs.split(2)


def test_without_reuse_a_request_takes_a_slot_next_to_the_busy_ones() -> None:
    s = sched(slots=6)
    for job in "abcdef":
        s.submit(job, (ord(job),), job, 0.0)
    run_prefill(s)
    for index in (0, 1, 3, 4, 5):
        s.release(index)  # only c (slot 2) runs; slot 5 was released last, slot 0 first
    s.submit("g", (1,), "g", 0.0)
    assert s.plan().assigned[0].slot == 1  # adjacent to 2 and least recently used of the adjacent ones
    s.submit("h", (2,), "h", 0.0)
    assert s.plan().assigned[0].slot == 0  # 0 and 3 are both adjacent now: 0's cache is the older
    s.submit("i", (3,), "i", 0.0)
    assert s.plan().assigned[0].slot == 3  # not 4 or 5, which would leave a gap


def test_call_costs_estimate_unmeasured_row_counts_on_a_line_through_the_nearest() -> None:
    costs = CallCosts()
    assert costs.seconds(4) is None
    costs.observe(2, 0.020)
    assert costs.seconds(2) == 0.020 and costs.seconds(4) is None  # one count: no line yet
    costs.observe(10, 0.100)
    assert costs.seconds(6) == pytest.approx(0.060)  # between the two
    assert costs.seconds(1) == pytest.approx(0.010) and costs.seconds(14) == pytest.approx(0.140)  # beyond them
    costs.observe(4, 0.030)
    assert costs.seconds(3) == pytest.approx(0.025) and costs.seconds(7) == pytest.approx(0.065)


def test_call_costs_beyond_the_measured_counts_stay_within_what_the_nearest_bounds() -> None:
    costs = CallCosts()
    costs.observe(2, 0.0002)
    costs.observe(3, 0.0005)  # a first call's graph set-up: the line through both would reach 0 at 1.33 rows
    assert costs.seconds(1) == pytest.approx(0.0001)  # no less per row than the 2-row call, never free
    costs.observe(4, 0.0004)
    assert costs.seconds(40) == pytest.approx(0.0004)  # the falling line: no less than the widest measured call
    costs.observe(10, 0.0010)
    assert costs.seconds(11) == pytest.approx(0.0011)
    costs = CallCosts()
    costs.observe(2, 0.0004)
    costs.observe(3, 0.0003)  # wider but cheaper (noise): a narrower call costs no more than the narrowest
    assert costs.seconds(1) == pytest.approx(0.0004) and costs.seconds(5) == pytest.approx(0.0003)


def test_a_window_adds_its_kept_drafts_after_the_decoded_token() -> None:
    s = sched(slots=1)
    s.submit("a", (1, 2, 3, 4), "x", 0.0)
    run_prefill(s)
    s.decoded(0, (7, 8))  # the row's token, then two kept drafts
    s.sampled(0, 9)
    assert s.slots[0].cached == [1, 2, 3, 4, 100, 7, 8]
    assert s.plan().decode == [DecodeRow(0, 9, 7)] and s.slots[0].exact == 4  # decoded tokens are never lent
