"""The compute runner: one worker thread per device state, where every native step on it runs.

llama.cpp and ggml calls take milliseconds to seconds and must not run on the event loop (lanes,
probes and the API would stall), and two calls must never touch one device's state at once (a KV
cache trimmed under a forward, a model freed under a step). A :class:`Runner` gives both: it owns
one thread, jobs wait in one queue, and the thread runs them one at a time. The whole-model engines
(:mod:`meshllm.engine.llama`, :mod:`meshllm.engine.ggml.engine`, the embedder of
:mod:`meshllm.engine.embed`) and a node's split stages (:mod:`meshllm.split.stage`, with its local
coordinators) run their forwards, KV edits and frees through one: the node's stages share one, each
engine owns one (two served models compute side by side, as they did with a thread each). Host work
that touches no device state (loading, tokenizing, compiling a grammar) stays in asyncio's default
executor.

**Order.** Jobs run by priority, then in the order they were submitted: a decode step
(:attr:`Priority.DECODE`, a token someone is waiting for) goes before prompt chunks and frees
(:attr:`Priority.PREFILL`), as the llama engine's scheduler puts a step's decode rows before its
prefill chunks. (A split coordinator queues its first stage's prompt chunks as decode steps, in turn
with its passes: it can keep the device's queue full of passes, and a chunk ranked below them waited
until the other requests ended.)

**Cancellation.** A job either never starts or runs to its end: cancelling the caller of :meth:`Runner.run`
takes its job out of the queue if it has not started (it is skipped, its native state untouched), and
otherwise returns at once while the job finishes on the thread; the next job starts only after it.
So a caller that frees what its job used (a session's KV, a grammar) submits the free as a job of its
own, which runs after the step in flight (:meth:`Runner.submit`, then :meth:`Runner.wait` if it must
know: leaving that wait never skips the job).

**Deadlines.** Every wait has one (:data:`DEFAULT_TIMEOUT_S` unless the caller gives its own): a job
still queued at its deadline is skipped, one still running is left to finish, and the caller gets
:class:`ComputeTimeout`.

**Inline steps.** A thread hand-off costs about 0.1-0.2 ms each way, which is most of a small split
stage's decode step and shows up directly in the per-hop overhead. A runner made with
``inline_max_s`` runs a ``small`` job on the event loop when the last job of its kind took less than
that and the device is idle (nothing queued or running); it holds the device meanwhile, so the
thread waits for it.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any, TypeVar

from meshllm.errors import MeshllmError

T = TypeVar("T")

DEFAULT_TIMEOUT_S = 300.0
"""Longest a caller waits for its job (queue and run) unless it says otherwise: a backstop, not a
step deadline (callers with their own, such as a split chain's, give them)."""
INLINE_MAX_S = 0.002
"""Largest measured step time a split stage's runner still runs on the event loop."""
CLOSE_TIMEOUT_S = 30.0
"""Longest :meth:`Runner.aclose` waits for the queued jobs and the one in flight."""


class Priority(IntEnum):
    """Which queued job runs first (lower first; submission order among equals)."""

    DECODE = 0
    """A step someone is waiting on token by token (decode passes, KV resets)."""
    PREFILL = 1
    """Bulk work: prompt chunks, freeing a model."""


class RunnerError(MeshllmError):
    """A job could not run on its device."""


class RunnerClosed(RunnerError):
    """The runner was closed: it takes no new jobs."""


class ComputeTimeout(RunnerError):
    """A job did not finish within its caller's deadline."""


@dataclass(order=True)
class _Job:
    priority: int
    seq: int
    kind: str = field(compare=False)
    fn: Callable[[], Any] = field(compare=False)
    future: Future[Any] = field(compare=False)


class Runner:
    """One device's job queue and the one thread that runs it (started with the first job)."""

    def __init__(self, name: str, *, inline_max_s: float = 0.0, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        self.name = name
        self.inline_max_s = inline_max_s
        self.timeout_s = timeout_s
        self._cond = threading.Condition()
        self._queue: list[_Job] = []
        self._seq = itertools.count()
        self._running = False
        """The thread is inside a job."""
        self._inline = False
        """The event loop is inside a job (the thread waits)."""
        self._closed = False
        self._thread: threading.Thread | None = None
        self._stopped: Future[None] = Future()
        self._last: dict[str, float] = {}
        """Seconds the last job of each kind took (whether the next may run inline)."""

    @property
    def queued(self) -> int:
        """Jobs waiting to start."""
        with self._cond:
            return len(self._queue)

    @property
    def busy(self) -> bool:
        """A job is running (on the thread or inline)."""
        with self._cond:
            return self._running or self._inline

    def submit(self, kind: str, fn: Callable[[], T], *, priority: Priority = Priority.DECODE) -> Future[T]:
        """Queue ``fn()`` (from any thread); its future gives the result, or is cancelled if skipped.

        Cancelling the future before the job starts skips it; once started, it runs to its end.
        """
        future: Future[T] = Future()
        with self._cond:
            if self._closed:
                raise RunnerClosed(f"{self.name} is closed")
            heapq.heappush(self._queue, _Job(int(priority), next(self._seq), kind, fn, future))
            if self._thread is None:
                self._thread = threading.Thread(target=self._work, name=self.name, daemon=True)
                self._thread.start()
            self._cond.notify_all()
        return future

    async def run(self, kind: str, small: bool, fn: Callable[[], T], *, priority: Priority = Priority.DECODE,
                  timeout_s: float | None = None) -> T:
        """``fn()`` on the device: inline if ``small`` and allowed (see the module), else on the thread.

        ``kind`` names the job for its timing record. A cancelled caller gets
        :class:`asyncio.CancelledError` at once: its job is skipped if it had not started, else it
        finishes on the thread before the next one starts. Raises :class:`ComputeTimeout` after
        ``timeout_s`` (default: the runner's), :class:`RunnerClosed` once closed, and whatever
        ``fn`` raised.
        """
        if small and self._last.get(kind, float("inf")) < self.inline_max_s:
            with self._cond:
                free = not (self._closed or self._queue or self._running or self._inline)
                self._inline = free
            if free:
                try:
                    return self._timed(kind, fn)
                finally:
                    with self._cond:
                        self._inline = False
                        if self._queue or self._closed:  # else the thread has nothing to wake up for:
                            self._cond.notify_all()      # a wake-up costs a futex and a GIL hand-off per step
        future = self.submit(kind, fn, priority=priority)
        try:
            return await self.wait(future, kind=kind, timeout_s=timeout_s)
        except asyncio.CancelledError:
            future.cancel()  # skipped if still queued; a running job finishes on the thread
            raise
        except ComputeTimeout as exc:
            skipped = future.cancel()
            raise ComputeTimeout(f"{exc} ({'skipped: it had not started' if skipped else 'it is still running'})") \
                from None

    async def wait(self, future: Future[T], *, kind: str = "a job", timeout_s: float | None = None) -> T:
        """The outcome of a job :meth:`submit` queued, waiting at most ``timeout_s`` (default: the runner's).

        Leaving the wait (cancelled, or :class:`ComputeTimeout` at the deadline) leaves the job as it
        is: queued or running, it still runs (what a free or a close needs).
        """
        waiter = asyncio.wrap_future(future)
        waiter.add_done_callback(_retrieve)  # (a caller that left no longer reads its outcome)
        deadline = self.timeout_s if timeout_s is None else timeout_s
        done, _ = await asyncio.wait([waiter], timeout=deadline)
        if not done:
            raise ComputeTimeout(f"{self.name}: {kind} did not finish within {deadline:g}s")
        return waiter.result()

    def close(self) -> None:
        """Take no new jobs; the queued ones still run, then the thread ends."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
            if self._thread is None and not self._stopped.done():
                self._stopped.set_result(None)

    async def aclose(self, timeout_s: float = CLOSE_TIMEOUT_S) -> None:
        """:meth:`close`, then wait (at most ``timeout_s``) until the queue is empty and the thread has ended."""
        self.close()
        done, _ = await asyncio.wait([asyncio.wrap_future(self._stopped)], timeout=timeout_s)
        if not done:
            raise ComputeTimeout(f"{self.name}: its jobs did not end within {timeout_s:g}s of closing")

    def _work(self) -> None:
        while True:
            with self._cond:
                while not self._queue or self._inline:
                    if self._closed and not self._queue and not self._inline:
                        self._stopped.set_result(None)
                        return
                    self._cond.wait()
                job = heapq.heappop(self._queue)
                if not job.future.set_running_or_notify_cancel():
                    continue  # its caller left before it started
                self._running = True
            result: Any = None
            error: BaseException | None = None
            try:
                result = self._timed(job.kind, job.fn)
            except BaseException as exc:  # the caller's to handle; the thread goes on
                error = exc
            with self._cond:
                self._running = False
                self._cond.notify_all()
            if error is not None:
                job.future.set_exception(error)
            else:
                job.future.set_result(result)
            del job, result, error  # (nothing of a finished job stays referenced while the thread waits)

    def _timed(self, kind: str, fn: Callable[[], T]) -> T:
        started = time.perf_counter()
        try:
            return fn()
        finally:
            self._last[kind] = time.perf_counter() - started


def _retrieve(waiter: asyncio.Future[Any]) -> None:
    if not waiter.cancelled():
        waiter.exception()
