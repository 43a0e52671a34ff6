"""Admission: a bounded, fair wait for a place on the node, and 429 with Retry-After beyond it."""

from __future__ import annotations

import asyncio

import pytest
from net.net_helpers import until

from meshllm.api.limits import Admission
from meshllm.runtime.errors import Saturated


async def hold(admission: Admission, client: str, order: list[str], name: str, until: asyncio.Event) -> None:
    await admission.acquire(client)
    order.append(name)
    try:
        await until.wait()
    finally:
        admission.release()


def test_waiters_take_turns_by_client_and_a_flood_gives_way() -> None:
    async def scenario() -> tuple[list[str], list[str]]:
        admission = Admission(limit=1, timeout_s=5.0, max_waiting=4)
        order: list[str] = []
        gates = {name: asyncio.Event() for name in ["a0", "a1", "a2", "a3", "a4", "b0", "c0"]}
        tasks = {"a0": asyncio.ensure_future(hold(admission, "a", order, "a0", gates["a0"]))}
        await asyncio.sleep(0)
        for name in ["a1", "a2", "a3", "a4"]:
            tasks[name] = asyncio.ensure_future(hold(admission, "a", order, name, gates[name]))
            await asyncio.sleep(0)
        for name, client in [("b0", "b"), ("c0", "c")]:  # the queue is full of a's: b and c still get in
            tasks[name] = asyncio.ensure_future(hold(admission, client, order, name, gates[name]))
            await asyncio.sleep(0)
        for name in ["a0", "a1", "b0", "c0", "a2"]:
            await until(lambda name=name: name in order)  # type: ignore[misc]
            gates[name].set()
        results = await asyncio.gather(*tasks.values(), return_exceptions=True)
        refused = [name for name, r in zip(tasks, results, strict=True) if isinstance(r, Saturated)]
        assert admission.active == 0 and admission.waiting == 0
        return order, refused

    order, refused = asyncio.run(scenario())
    assert refused == ["a3", "a4"]  # a's newest gave way to b and c
    assert order == ["a0", "a1", "b0", "c0", "a2"]  # a1 waited first; then each client in turn


def test_no_place_and_too_long_a_wait_are_429_with_a_retry_hint() -> None:
    async def scenario() -> None:
        admission = Admission(limit=1, timeout_s=0.1, max_waiting=1)
        await admission.acquire("x")
        with pytest.raises(Saturated, match=r"waited 0\.1s") as waited:
            await admission.acquire("y")
        waiting = asyncio.ensure_future(admission.acquire("y"))
        await asyncio.sleep(0)
        with pytest.raises(Saturated, match="already has 1 of the 1 queue places") as full:
            await admission.acquire("y")
        for exc in (waited.value, full.value):
            assert exc.status == 429 and int(exc.headers["retry-after"]) >= 1
        admission.release()
        await waiting
        admission.release()
        assert admission.active == 0

    asyncio.run(scenario())


def test_a_waiter_that_gives_up_leaves_its_place() -> None:
    async def scenario() -> None:
        admission = Admission(limit=1, timeout_s=5.0)
        await admission.acquire()
        waiter = asyncio.ensure_future(admission.acquire())
        await asyncio.sleep(0)
        assert admission.waiting == 1
        waiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiter
        assert admission.waiting == 0
        admission.release()
        assert admission.active == 0

    asyncio.run(scenario())
