"""Background tasks that outlive the call that starts them.

asyncio keeps only weak references to running tasks, so a task nobody holds can be garbage-collected
before it ends. :class:`Scope` gives a component one task group for all the work it fires off (the
split components use it); :func:`task_group` is the group of one call (an API request's choices, a
request and the watcher of its caller), whose tasks end before the call returns; :func:`spawn` keeps
a task in a set of the caller's own until it ends.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Coroutine
from typing import Any, TypeVar

T = TypeVar("T")
log = logging.getLogger(__name__)


def spawn(tasks: set[asyncio.Task[Any]], work: Coroutine[Any, Any, T], name: str | None = None) -> asyncio.Task[T]:
    """Run ``work`` as a task held in ``tasks`` until it is done (called on the loop's thread)."""
    task = asyncio.get_running_loop().create_task(work, name=name)
    tasks.add(task)
    task.add_done_callback(tasks.discard)
    return task


@contextlib.asynccontextmanager
async def task_group() -> AsyncIterator[asyncio.TaskGroup]:
    """An :class:`asyncio.TaskGroup` for the tasks of one call, raising a failure as itself.

    Every task the call starts is made in the group, so it is cancelled with the call (a failure of one
    cancels the others) and has ended when the block is left. Where the group would raise an
    :class:`ExceptionGroup`, this raises its first exception: callers (the API's error handlers) map one
    error to one answer. The caller's own cancellation is never swallowed.
    """
    try:
        async with asyncio.TaskGroup() as group:
            yield group
    except BaseExceptionGroup as errors:
        raise errors.exceptions[0] from None


class Scope:
    """A component's :class:`asyncio.TaskGroup`, held open by a task of its own while it has work.

    Components built and closed from plain functions (a stage server, a lane pool, a coordinator)
    still get structured concurrency: every task they start lives in one group, an exception in one
    is logged rather than lost (its siblings go on), and :meth:`aclose` cancels them all and returns
    only when every one has ended (a group's exit waits for its children). The group's task ends
    when its last task does, so an idle component holds no task, and a component dropped without
    being closed leaves nothing pending behind.
    """

    def __init__(self, name: str) -> None:
        self.name = name
        self._group: asyncio.TaskGroup | None = None
        self._early: list[tuple[Coroutine[Any, Any, Any], asyncio.Future[None]]] = []
        """Work spawned before the group's task first ran: started by it, in order."""
        self._runner: asyncio.Task[None] | None = None
        self._starting = False
        self._live = 0
        self._idle = asyncio.Event()
        self._closed = False

    def spawn(self, work: Coroutine[Any, Any, Any]) -> asyncio.Future[None]:
        """Run ``work`` in the group (called on the loop's thread); dropped (closed) once the scope is.

        The returned future resolves when ``work`` has ended, however it ended: waiting on it never
        raises ``work``'s error, and cancelling the waiter does not cancel ``work``.
        """
        ended: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        if self._closed:
            work.close()
            ended.set_result(None)
            return ended
        self._live += 1
        if self._group is not None:
            self._group.create_task(self._logged(work, ended))
            return ended
        self._early.append((work, ended))
        if not self._starting:
            self._starting = True
            self._runner = asyncio.get_running_loop().create_task(self._hold(), name=self.name)
        return ended

    def close(self) -> None:
        """Cancel every task of the scope (they end on the loop; :meth:`aclose` waits for them)."""
        self._closed = True
        for work, ended in self._early:
            work.close()
            ended.set_result(None)
        self._early.clear()
        if self._runner is not None:
            self._runner.cancel()

    async def aclose(self) -> None:
        """Cancel every task of the scope and wait until all have ended."""
        self.close()
        if self._runner is not None:
            await asyncio.wait([self._runner])

    async def _hold(self) -> None:
        async with asyncio.TaskGroup() as group:
            self._group, self._starting = group, False
            early, self._early = self._early, []
            for work, ended in early:
                group.create_task(self._logged(work, ended))
            while self._live:
                self._idle.clear()
                await self._idle.wait()
            self._group = None  # (no await since the check: work spawned from now on starts a new group)

    async def _logged(self, work: Coroutine[Any, Any, Any], ended: asyncio.Future[None]) -> None:
        try:
            await work
        except Exception:  # one task's bug must not cancel its siblings: it is logged, they go on
            log.exception("%s: a task failed", self.name)
        finally:
            if not ended.done():
                ended.set_result(None)
            self._live -= 1
            if not self._live:
                self._idle.set()
