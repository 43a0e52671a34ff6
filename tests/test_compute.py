"""The compute runner: order, cancellation before and while a job runs, failures, deadlines, one job at a time."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable

import pytest

from meshllm.compute import ComputeTimeout, Priority, Runner, RunnerClosed

WAIT_S = 10.0
"""Deadline of every wait in these tests (none should come near it)."""


def _hold(runner: Runner) -> tuple[threading.Event, threading.Event]:
    """Occupy ``runner``'s thread until the returned ``release`` is set; ``started`` is set once it runs."""
    started, release = threading.Event(), threading.Event()

    def hold() -> None:
        started.set()
        release.wait(WAIT_S)

    runner.submit("hold", hold)
    assert started.wait(WAIT_S)
    return started, release


def _held_job(out: list[str], name: str) -> tuple[Callable[[], None], threading.Event, threading.Event]:
    """A job that sets ``started``, runs until ``release`` is set, then appends ``name`` to ``out``."""
    started, release = threading.Event(), threading.Event()

    def job() -> None:
        started.set()
        release.wait(WAIT_S)
        out.append(name)

    return job, started, release


async def _until(predicate, what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.001)


def test_decode_jobs_go_before_prefill_jobs_and_equals_keep_their_order() -> None:
    async def main() -> list[str]:
        runner = Runner("test-order")
        ran: list[str] = []
        _, release = _hold(runner)
        calls = [runner.run(name, False, lambda name=name: ran.append(name), priority=priority)
                 for name, priority in [("p1", Priority.PREFILL), ("d1", Priority.DECODE),
                                        ("p2", Priority.PREFILL), ("d2", Priority.DECODE)]]
        tasks = [asyncio.ensure_future(c) for c in calls]
        await _until(lambda: runner.queued == 4, "every job queued")
        release.set()
        await asyncio.wait_for(asyncio.gather(*tasks), WAIT_S)
        await runner.aclose()
        return ran

    assert asyncio.run(main()) == ["d1", "d2", "p1", "p2"]


def test_a_caller_cancelled_before_its_job_starts_skips_it() -> None:
    async def main() -> tuple[list[str], bool]:
        runner = Runner("test-skip")
        ran: list[str] = []
        _, release = _hold(runner)
        skipped = asyncio.ensure_future(runner.run("skipped", False, lambda: ran.append("skipped")))
        await _until(lambda: runner.queued == 1, "the job queued")
        skipped.cancel()
        with pytest.raises(asyncio.CancelledError):
            await skipped
        release.set()
        await asyncio.wait_for(runner.run("next", False, lambda: ran.append("next")), WAIT_S)
        await runner.aclose()
        return ran, skipped.cancelled()

    assert asyncio.run(main()) == (["next"], True)


def test_a_caller_cancelled_while_its_job_runs_returns_at_once_and_the_job_finishes_first() -> None:
    """The cancelled caller does not wait for the thread; the next job starts only after the first ended."""

    async def main() -> list[str]:
        runner = Runner("test-cancel-running")
        events: list[str] = []
        long, started, release = _held_job(events, "long ended")
        caller = asyncio.ensure_future(runner.run("long", False, long))
        await _until(started.is_set, "the job to start")
        caller.cancel()
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(caller, WAIT_S)
        events.append("caller left")
        assert runner.busy  # the job is still on the thread
        follower = asyncio.ensure_future(runner.run("next", False, lambda: events.append("next ran")))
        await _until(lambda: runner.queued == 1, "the next job queued behind it")
        release.set()
        await asyncio.wait_for(follower, WAIT_S)
        await runner.aclose()
        return events

    assert asyncio.run(main()) == ["caller left", "long ended", "next ran"]


def test_a_job_that_raises_gives_its_caller_the_error_and_the_runner_goes_on() -> None:
    class Broken(Exception):
        pass

    def broken() -> None:
        raise Broken("native step failed")

    async def main() -> int:
        runner = Runner("test-raise")
        with pytest.raises(Broken, match="native step failed"):
            await runner.run("broken", False, broken)
        result = await runner.run("after", False, lambda: 41 + 1)
        await runner.aclose()
        return result

    assert asyncio.run(main()) == 42


def test_a_wait_past_its_deadline_raises_skipping_a_queued_job_and_leaving_a_running_one_to_finish() -> None:
    async def main() -> tuple[str, str, list[str]]:
        runner = Runner("test-deadline")
        ran: list[str] = []
        _, release = _hold(runner)
        with pytest.raises(ComputeTimeout) as queued:
            await runner.run("queued", False, lambda: ran.append("queued"), timeout_s=0.05)
        release.set()
        running, _, release_running = _held_job(ran, "running")
        with pytest.raises(ComputeTimeout) as late:
            await runner.run("running", False, running, timeout_s=0.05)
        release_running.set()
        await runner.run("after", False, lambda: ran.append("after"), timeout_s=WAIT_S)
        await runner.aclose()
        return str(queued.value), str(late.value), ran

    queued, late, ran = asyncio.run(main())
    assert "queued did not finish within 0.05s (skipped: it had not started)" in queued
    assert "running did not finish within 0.05s (it is still running)" in late
    assert ran == ["running", "after"]  # the job that timed out while queued never ran


def test_one_job_at_a_time_on_the_thread_and_inline() -> None:
    """Many callers, small jobs allowed inline on the loop and bigger ones on the thread: never two at once."""

    async def main() -> tuple[int, int, set[str]]:
        runner = Runner("test-exclusive", inline_max_s=1.0)  # (every small job qualifies once timed)
        lock = threading.Lock()
        inside = peak = 0
        threads: set[str] = set()

        def job(seconds: float) -> None:
            nonlocal inside, peak
            with lock:
                inside += 1
                peak = max(peak, inside)
            threads.add(threading.current_thread().name)
            time.sleep(seconds)
            with lock:
                inside -= 1

        async def caller(i: int) -> None:
            for k in range(10):
                small = (i + k) % 2 == 0
                await runner.run("small" if small else "big", small, lambda s=small: job(0 if s else 0.001),
                                 priority=Priority(k % 2))

        for _ in range(2):  # alone: the first goes to the thread (not timed yet), the second runs inline
            await runner.run("small", True, lambda: job(0))
        await asyncio.wait_for(asyncio.gather(*(caller(i) for i in range(6))), WAIT_S)
        await runner.aclose()
        return peak, inside, threads

    peak, inside, threads = asyncio.run(main())
    assert peak == 1 and inside == 0
    assert threads == {"MainThread", "test-exclusive"}  # both paths were taken


def test_inline_waits_for_a_busy_device() -> None:
    """A small job never runs inline beside a job on the thread: it queues behind it."""

    async def main() -> list[str]:
        runner = Runner("test-inline-busy", inline_max_s=1.0)
        await runner.run("small", True, lambda: None)  # (timed: the next small one may run inline)
        order: list[str] = []
        big, started, release = _held_job(order, "big")
        task = asyncio.ensure_future(runner.run("big", False, big))
        await _until(started.is_set, "the big job to start")
        small = asyncio.ensure_future(runner.run("small", True, lambda: order.append("small")))
        await _until(lambda: runner.queued == 1, "the small job queued")
        release.set()
        await asyncio.wait_for(asyncio.gather(task, small), WAIT_S)
        await runner.aclose()
        return order

    assert asyncio.run(main()) == ["big", "small"]


def test_close_runs_what_is_queued_then_refuses_new_jobs() -> None:
    async def main() -> list[str]:
        runner = Runner("test-close")
        ran: list[str] = []
        _, release = _hold(runner)
        queued = runner.submit("queued", lambda: ran.append("queued"), priority=Priority.PREFILL)
        runner.close()
        with pytest.raises(RunnerClosed):
            runner.submit("late", lambda: ran.append("late"))
        with pytest.raises(RunnerClosed):
            await runner.run("late", False, lambda: ran.append("late"))
        release.set()
        await runner.aclose()
        assert queued.done() and not queued.cancelled()
        return ran

    assert asyncio.run(main()) == ["queued"]


def test_submit_works_from_any_thread() -> None:
    runner = Runner("test-threads")
    futures = []

    def submitter(i: int) -> None:
        futures.append(runner.submit("n", lambda: i * i))

    workers = [threading.Thread(target=submitter, args=(i,)) for i in range(8)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(WAIT_S)
    assert sorted(f.result(WAIT_S) for f in futures) == [i * i for i in range(8)]
    runner.close()


def test_leaving_a_wait_on_a_submitted_job_does_not_skip_it() -> None:
    """What a free needs: its caller may be cancelled, the free still runs (after the job in flight)."""

    async def main() -> list[str]:
        runner = Runner("test-wait")
        ran: list[str] = []
        _, release = _hold(runner)
        freed = runner.submit("free", lambda: ran.append("freed"))
        waiter = asyncio.ensure_future(runner.wait(freed))
        await asyncio.sleep(0)
        waiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiter
        with pytest.raises(ComputeTimeout, match=r"free did not finish within 0\.01s"):
            await runner.wait(freed, kind="free", timeout_s=0.01)
        release.set()
        await runner.wait(freed, timeout_s=WAIT_S)
        await runner.aclose()
        return ran

    assert asyncio.run(main()) == ["freed"]
