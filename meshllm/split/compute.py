"""Where a stage's forward runs: inline on the event loop when it is tiny, else in a worker thread.

A thread hand-off costs about 0.1-0.2 ms each way, which is most of a small stage's decode step and
shows up directly in the per-hop overhead P. A step that took under :data:`INLINE_MAX_S` last time
runs inline (it blocks the loop for less than that); anything bigger, and every prompt chunk, goes
to a thread so the loop keeps serving lanes, probes and the API. One runner per node serialises
compute (a stage's ggml backend already uses the node's threads for one step).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")

INLINE_MAX_S = 0.002
"""Largest measured step time still run on the event loop."""


class Compute:
    """Serialised compute with a per-kind record of how long the last step took."""

    def __init__(self, inline_max_s: float = INLINE_MAX_S) -> None:
        self.inline_max_s = inline_max_s
        self.lock = asyncio.Lock()
        self._last: dict[str, float] = {}

    async def run(self, kind: str, small: bool, fn: Callable[[], T]) -> T:
        """``fn()`` inline if ``small`` and the last ``kind`` step was quick, else in a thread.

        A caller cancelled while its ``fn`` runs in the thread gets :class:`asyncio.CancelledError` at
        once, but the lock stays held until the thread is done: the next step never overlaps it.
        """
        await self.lock.acquire()
        if small and self._last.get(kind, float("inf")) < self.inline_max_s:
            try:
                return self._timed(kind, fn)
            finally:
                self.lock.release()
        try:
            work = asyncio.ensure_future(asyncio.to_thread(self._timed, kind, fn))
        except BaseException:
            self.lock.release()
            raise
        work.add_done_callback(self._done)
        return await asyncio.shield(work)

    def _done(self, work: asyncio.Future[object]) -> None:
        self.lock.release()
        if not work.cancelled():
            work.exception()  # (retrieved: a cancelled caller no longer awaits it)

    def _timed(self, kind: str, fn: Callable[[], T]) -> T:
        started = time.perf_counter()
        try:
            return fn()
        finally:
            self._last[kind] = time.perf_counter() - started
