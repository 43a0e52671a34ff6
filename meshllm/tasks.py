"""Background tasks that outlive the call that starts them.

asyncio keeps only weak references to running tasks, so a task nobody holds can be garbage-collected
before it ends. Every component that fires work off (a stream handler, a Stop sent on, a session's
release) keeps its tasks in a set of its own, which its ``close`` can also cancel; :func:`spawn` is
the one way such a task is started and dropped from that set when it ends.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


def spawn(tasks: set[asyncio.Task[Any]], work: Coroutine[Any, Any, T], name: str | None = None) -> asyncio.Task[T]:
    """Run ``work`` as a task held in ``tasks`` until it is done (called on the loop's thread)."""
    task = asyncio.get_running_loop().create_task(work, name=name)
    tasks.add(task)
    task.add_done_callback(tasks.discard)
    return task
