"""The node's event hub: one place every part reports what happened.

Events go to three readers: the log (pretty or one JSON object per line), the ``/api/events``
server-sent-event stream, and tests. Subscribers get a bounded queue: a slow reader loses its
oldest events, it never slows the node down.

The history is what a reader that connects late is told first, so it keeps what happened to the
node (``ready``, ``peer_joined``, ``model_ready``, ...), not the gossip heartbeat: every member's
record refresh is a ``record_updated`` event, a few a second on a busy mesh, and kept in the history
they would push everything else out of it within a minute. Those are streamed live only.
"""

from __future__ import annotations

import asyncio
import collections
import time
from collections.abc import Callable
from typing import Any

Event = dict[str, Any]

LIVE_ONLY = frozenset({"record_updated"})
"""Event types streamed to subscribers but kept out of the history (see the module docstring)."""


class EventHub:
    """Fan-out of node events to subscribers and a short history."""

    def __init__(self, history: int = 100, queue_size: int = 256, live_only: frozenset[str] = LIVE_ONLY) -> None:
        self._history: collections.deque[Event] = collections.deque(maxlen=history)
        self._live_only = live_only
        self._queues: set[asyncio.Queue[Event]] = set()
        self._queue_size = queue_size
        self._sinks: list[Callable[[Event], None]] = []

    def add_sink(self, sink: Callable[[Event], None]) -> None:
        """Call ``sink(event)`` synchronously for every event (used for logging)."""
        self._sinks.append(sink)

    def publish(self, type_: str, **fields: Any) -> Event:
        """Record an event ``{"type", "ts", **fields}`` and hand it to every reader."""
        event: Event = {"type": type_, "ts": round(time.time(), 3), **fields}
        if type_ not in self._live_only:
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

    def subscribe(self) -> Subscription:
        """Events published from this call on.

        The subscription is in place when this returns, so ``subscribe()`` then :meth:`recent` in the
        same step of the event loop gives a history and a live stream with nothing lost between them.
        """
        return Subscription(self._queues, self._queue_size)


class Subscription:
    """One reader's queue of live events; :meth:`aclose` unsubscribes."""

    def __init__(self, queues: set[asyncio.Queue[Event]], size: int) -> None:
        self._queues = queues
        self._queue: asyncio.Queue[Event] = asyncio.Queue(size)
        queues.add(self._queue)

    def __aiter__(self) -> Subscription:
        return self

    async def __anext__(self) -> Event:
        if self._queue not in self._queues:
            raise StopAsyncIteration
        return await self._queue.get()

    async def aclose(self) -> None:
        """Stop receiving events."""
        self._queues.discard(self._queue)
