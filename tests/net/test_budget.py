"""The frame budget (sans-IO): all or nothing, first come first served, per connection and in total."""

from __future__ import annotations

from meshllm.net.budget import FrameBudget


class Waiter:
    def __init__(self) -> None:
        self.granted: list[int] = []

    def on_reserved(self, size: int) -> None:
        self.granted.append(size)


def test_reservations_fit_both_budgets_and_queue_otherwise() -> None:
    budget = FrameBudget(total=100, per_connection=60)
    a, b = object(), object()
    first, second, third = Waiter(), Waiter(), Waiter()
    assert budget.reserve(a, first, 60)
    assert not budget.reserve(a, second, 10)  # a is at its own budget
    assert not budget.reserve(b, third, 50)  # queued behind a's waiter (first come, first served) ...
    assert budget.used == 60
    budget.release(a, 60)
    assert second.granted == [10] and third.granted == [50] and budget.used == 60
    assert budget.held(a) == 10 and budget.held(b) == 50


def test_a_waiter_that_does_not_fit_yet_keeps_its_place_but_does_not_block_others() -> None:
    budget = FrameBudget(total=100, per_connection=100)
    a, b = object(), object()
    big, small = Waiter(), Waiter()
    assert budget.reserve(a, Waiter(), 70)
    assert not budget.reserve(b, big, 50)
    assert not budget.reserve(a, small, 20)
    budget.release(a, 0)  # any release re-runs the queue
    assert small.granted == [20] and big.granted == []
    budget.release(a, 90)
    assert big.granted == [50]


def test_cancelled_waiters_are_forgotten_and_sizes_beyond_any_budget_are_known() -> None:
    budget = FrameBudget(total=100, per_connection=40)
    owner, waiter = object(), Waiter()
    assert budget.reserve(owner, Waiter(), 40)
    assert not budget.reserve(owner, waiter, 10)
    budget.cancel(waiter)
    budget.release(owner, 40)
    assert waiter.granted == [] and budget.used == 0
    assert budget.fits(40) and not budget.fits(41)
