"""Room for large frames (sans-IO): one budget per connection and one for the whole endpoint.

A frame longer than half a stream window cannot arrive on stream credit alone, so its stream
reserves the frame's whole size here first (see :mod:`.streams`). A reservation is all or
nothing, granted first come, first served, and held until the frame has been read, so large
frames never deadlock each other half-way and never add up beyond the budgets: one connection
holds at most ``per_connection``, all connections together at most ``total``.
"""

from __future__ import annotations

from collections import deque
from typing import Protocol


class Waiter(Protocol):
    """A stream waiting for room."""

    def on_reserved(self, size: int) -> None:
        """The room it asked for is now reserved for it."""


class FrameBudget:
    """Reservations of large-frame room, per owner (a connection) and in total."""

    def __init__(self, total: int, per_connection: int) -> None:
        self.total, self.per_connection = total, per_connection
        self.used = 0
        self._by_owner: dict[object, int] = {}
        self._queue: deque[tuple[object, Waiter, int]] = deque()

    def held(self, owner: object) -> int:
        """Bytes reserved for ``owner`` now."""
        return self._by_owner.get(owner, 0)

    def fits(self, size: int) -> bool:
        """Whether a frame of ``size`` bytes could ever be granted."""
        return size <= min(self.total, self.per_connection)

    def reserve(self, owner: object, waiter: Waiter, size: int) -> bool:
        """Reserve ``size`` bytes for ``owner`` now (True), or queue ``waiter`` (False)."""
        if not self._queue and self._room(owner, size):
            self._take(owner, size)
            return True
        self._queue.append((owner, waiter, size))
        return False

    def release(self, owner: object, size: int) -> None:
        """``owner`` gives ``size`` reserved bytes back; waiters that now fit are granted, in order."""
        left = self._by_owner.get(owner, 0) - size
        if left > 0:
            self._by_owner[owner] = left
        else:
            self._by_owner.pop(owner, None)
        self.used = max(0, self.used - size)
        self._grant()

    def cancel(self, waiter: Waiter) -> None:
        """``waiter`` no longer wants room."""
        self._queue = deque(entry for entry in self._queue if entry[1] is not waiter)
        self._grant()

    def _room(self, owner: object, size: int) -> bool:
        return self.used + size <= self.total and self._by_owner.get(owner, 0) + size <= self.per_connection

    def _take(self, owner: object, size: int) -> None:
        self.used += size
        self._by_owner[owner] = self._by_owner.get(owner, 0) + size

    def _grant(self) -> None:
        """Grant queued reservations that fit, oldest first; one that does not fit keeps its place."""
        waiting: deque[tuple[object, Waiter, int]] = deque()
        granted = []
        for owner, waiter, size in self._queue:
            if self._room(owner, size) and not any(o is owner for o, _, _ in waiting):
                self._take(owner, size)
                granted.append((waiter, size))
            else:
                waiting.append((owner, waiter, size))
        self._queue = waiting
        for waiter, size in granted:
            waiter.on_reserved(size)
