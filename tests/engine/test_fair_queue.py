"""The fair queue on its own: turns without holdings, removal, bounds."""

from __future__ import annotations

import pytest

from meshllm.engine.fair_queue import FairQueue, QueueFull


def test_turns_go_to_the_client_served_longest_ago() -> None:
    q: FairQueue[str] = FairQueue(10)
    for item, client in [("a1", "a"), ("a2", "a"), ("a3", "a"), ("b1", "b"), ("c1", "c")]:
        q.push(item, client, 0.0)
    assert [q.pop() for _ in range(5)] == ["a1", "b1", "c1", "a2", "a3"]
    with pytest.raises(IndexError):
        q.pop()


def test_holdings_come_before_turns() -> None:
    q: FairQueue[str] = FairQueue(10)
    q.push("a1", "a", 0.0)
    q.push("b1", "b", 1.0)
    assert q.pop({"a": 2, "b": 1}) == "b1"


def test_remove_and_zero_places() -> None:
    q: FairQueue[str] = FairQueue(2)
    q.push("x", "a", 0.0)
    assert q.remove("x") and not q.remove("x") and len(q) == 0
    with pytest.raises(QueueFull):
        FairQueue[str](0).push("y", "a", 0.0)
