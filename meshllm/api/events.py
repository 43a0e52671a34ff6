"""The node's event hub: one place every part reports what happened.

Events go to three readers: the log (pretty or one JSON object per line), the ``/api/events``
server-sent-event stream, and tests. Subscribers get a bounded queue: a slow reader loses its
oldest events, it never slows the node down.
"""

from __future__ import annotations

import asyncio
import collections
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

Event = dict[str, Any]


class EventHub:
    """Fan-out of node events to subscribers and a short history."""

    def __init__(self, history: int = 100, queue_size: int = 256) -> None:
        self._history: collections.deque[Event] = collections.deque(maxlen=history)
        self._queues: set[asyncio.Queue[Event]] = set()
        self._queue_size = queue_size
        self._sinks: list[Callable[[Event], None]] = []

    def add_sink(self, sink: Callable[[Event], None]) -> None:
        """Call ``sink(event)`` synchronously for every event (used for logging)."""
        self._sinks.append(sink)

    def publish(self, type_: str, **fields: Any) -> Event:
        """Record an event ``{"type", "ts", **fields}`` and hand it to every reader."""
        event: Event = {"type": type_, "ts": round(time.time(), 3), **fields}
        self._history.append(event)
        for sink in self._sinks:
            sink(event)
        for queue in self._queues:
            if queue.full():
                queue.get_nowait()
            queue.put_nowait(event)
        return event

    def recent(self) -> list[Event]:
        """The last events, oldest first."""
        return list(self._history)

    async def subscribe(self) -> AsyncIterator[Event]:
        """Yield events as they happen, starting after the call."""
        queue: asyncio.Queue[Event] = asyncio.Queue(self._queue_size)
        self._queues.add(queue)
        try:
            while True:
                yield await queue.get()
        finally:
            self._queues.discard(queue)
