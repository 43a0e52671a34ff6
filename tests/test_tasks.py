"""``spawn``, ``Scope`` and ``task_group``: every task is owned, ends with its owner, and its errors are not lost."""

from __future__ import annotations

import asyncio
import gc

from meshllm.tasks import Scope, spawn, task_group


def test_a_spawned_task_is_held_until_done_then_dropped() -> None:
    async def main() -> None:
        tasks: set[asyncio.Task[object]] = set()
        release = asyncio.Event()

        async def work() -> str:
            await release.wait()
            return "done"

        task = spawn(tasks, work(), name="held")
        del task
        gc.collect()  # the set is what keeps it alive while nobody else holds it
        (held,) = tasks
        assert held.get_name() == "held" and not held.done()
        release.set()
        assert await held == "done"
        await asyncio.sleep(0)  # done callbacks run on the next loop turn
        assert tasks == set()

    asyncio.run(main())


def test_a_failed_or_cancelled_task_leaves_the_set_too() -> None:
    async def main() -> None:
        tasks: set[asyncio.Task[object]] = set()

        async def fail() -> None:
            raise ValueError("bad")

        failed = spawn(tasks, fail())
        hung = spawn(tasks, asyncio.sleep(3600))
        hung.cancel()
        await asyncio.gather(failed, hung, return_exceptions=True)
        await asyncio.sleep(0)
        assert tasks == set() and isinstance(failed.exception(), ValueError) and hung.cancelled()

    asyncio.run(main())


def test_a_scope_runs_its_work_in_one_group_and_a_failure_spares_the_siblings(caplog) -> None:  # type: ignore[no-untyped-def]
    async def main() -> list[str]:
        scope = Scope("test scope")
        done: list[str] = []
        gate = asyncio.Event()

        async def work(name: str) -> None:
            await gate.wait()
            if name == "bad":
                raise RuntimeError("a bug")
            done.append(name)

        ended = [scope.spawn(work(n)) for n in ("a", "bad", "b")]  # before the group's task first ran
        await asyncio.sleep(0)
        gate.set()
        await asyncio.wait(ended)
        return done

    assert asyncio.run(main()) == ["a", "b"]
    assert "test scope: a task failed" in caplog.text


def test_closing_a_scope_cancels_its_work_and_waits_and_an_idle_scope_holds_no_task() -> None:
    async def main() -> None:
        scope = Scope("test scope")
        cancelled = asyncio.Event()

        async def forever() -> None:
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                cancelled.set()
                raise

        async def quick() -> None:
            pass

        await asyncio.wait([scope.spawn(quick())])
        await asyncio.sleep(0)
        assert {t.get_name() for t in asyncio.all_tasks()} == {asyncio.current_task().get_name()}  # type: ignore[union-attr]
        scope.spawn(forever())
        await asyncio.sleep(0)
        await scope.aclose()
        assert cancelled.is_set()
        late = quick()
        await asyncio.wait([scope.spawn(late)])  # a closed scope runs nothing more
        assert late.cr_frame is None  # (closed, never run)

    asyncio.run(main())


def test_a_task_group_raises_the_first_failure_itself_after_cancelling_the_others() -> None:
    async def main() -> tuple[Exception, bool]:
        sibling_ended = asyncio.Event()

        async def sibling() -> None:
            try:
                await asyncio.Event().wait()
            finally:
                sibling_ended.set()

        async def fail() -> None:
            raise ValueError("one choice failed")

        try:
            async with task_group() as group:
                group.create_task(sibling())
                group.create_task(fail())
        except ValueError as exc:  # (not an ExceptionGroup: the API maps one error to one status)
            return exc, sibling_ended.is_set()
        raise AssertionError("the failure was lost")

    exc, ended = asyncio.run(main())
    assert str(exc) == "one choice failed" and ended  # the sibling had ended when the error came out


def test_cancelling_a_task_groups_caller_cancels_its_tasks_and_is_not_swallowed() -> None:
    async def main() -> tuple[bool, bool]:
        child_cancelled = asyncio.Event()
        entered = asyncio.Event()

        async def child() -> None:
            try:
                entered.set()
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                child_cancelled.set()
                raise

        async def caller() -> None:
            async with task_group() as group:
                group.create_task(child())

        task = asyncio.ensure_future(caller())
        await asyncio.wait_for(entered.wait(), 10.0)
        task.cancel()
        await asyncio.wait([task], timeout=10.0)
        return task.cancelled(), child_cancelled.is_set()

    assert asyncio.run(main()) == (True, True)


def test_a_task_group_waits_for_every_task_before_it_is_left() -> None:
    async def main() -> list[int]:
        async def square(n: int) -> int:
            await asyncio.sleep(0)
            return n * n

        async with task_group() as group:
            tasks = [group.create_task(square(n)) for n in range(4)]
        return [t.result() for t in tasks]

    assert asyncio.run(main()) == [0, 1, 4, 9]
