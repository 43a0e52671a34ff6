"""``spawn``: a background task is held until it is done, then dropped, and its result is its own."""

from __future__ import annotations

import asyncio
import gc

from meshllm.tasks import spawn


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
