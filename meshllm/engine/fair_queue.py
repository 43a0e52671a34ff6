"""A bounded waiting queue shared fairly between clients (sans-IO; time is passed in).

Used twice: by the llama.cpp engine's slot scheduler (requests waiting for a slot) and by the API's
admission (requests waiting for a place on the node). A client is whatever the caller names (an
API ``user``, else an HTTP connection).

* **Taking turns**: :meth:`FairQueue.pop` takes the request of the client holding the fewest
  places now (when the caller says), then of the client served longest ago, then the oldest.
  A client that floods the queue is served in turn with the others, not before them.
* **Fair share of the places**: when the queue is full, a client holding less than its share
  (``max_waiting // clients``, at least one) still gets in: the newest request of the client
  holding the most places gives way (:meth:`FairQueue.push` returns it). A client at or over its
  share, or a full queue where nobody is over theirs, is refused with :class:`QueueFull`.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Generic, TypeVar

T = TypeVar("T")


class QueueFull(Exception):
    """The waiting queue, or this client's share of it, is full."""


@dataclass(eq=False)
class _Entry(Generic[T]):
    item: T
    client: str
    since: float
    seq: int


class FairQueue(Generic[T]):
    """Waiting items with their clients: fair turns, fair shares, a bound and an age."""

    def __init__(self, max_waiting: int) -> None:
        if max_waiting < 0:
            raise ValueError("max_waiting must be >= 0")
        self.max_waiting = max_waiting
        self._entries: list[_Entry[T]] = []
        self._served: dict[str, int] = {}
        """When each client present last left the queue (turns go to the one served longest ago)."""
        self._seq = 0

    def __len__(self) -> int:
        return len(self._entries)

    def __iter__(self) -> Iterator[T]:
        return (e.item for e in self._entries)

    def push(self, item: T, client: str, now: float) -> list[T]:
        """Queue ``item`` for ``client``; return the items it displaced. Raises :class:`QueueFull`."""
        displaced: list[T] = []
        if len(self._entries) >= self.max_waiting:
            counts = Counter(e.client for e in self._entries)
            share = max(1, self.max_waiting // len(counts.keys() | {client}))
            if counts[client] >= share:
                raise QueueFull(f"this client already has {counts[client]} of the {self.max_waiting} queue places")
            most = max(counts.values(), default=0)
            over = [e for e in self._entries if counts[e.client] == most > share]
            if not over:
                raise QueueFull(f"{len(self._entries)} requests are waiting (limit {self.max_waiting})")
            victim = max(over, key=lambda e: e.seq)  # the newest request of the client holding the most
            self._entries.remove(victim)
            displaced.append(victim.item)
        self._seq += 1
        self._entries.append(_Entry(item, client, now, self._seq))
        return displaced

    def pop(self, holding: Mapping[str, int] | None = None) -> T:
        """The next item: fewest places ``holding`` (if given), then served longest ago, then oldest."""
        if not self._entries:
            raise IndexError("pop from an empty FairQueue")
        held = holding or {}
        best = min(self._entries, key=lambda e: (held.get(e.client, 0), self._served.get(e.client, 0), e.seq))
        self._entries.remove(best)
        self._seq += 1
        self._served[best.client] = self._seq
        present = set(held) | {e.client for e in self._entries} | {best.client}
        for gone in self._served.keys() - present:  # bounded by the clients waiting or holding now
            del self._served[gone]
        return best.item

    def remove(self, item: T) -> bool:
        """Take ``item`` out (it gave up); whether it was there."""
        for e in self._entries:
            if e.item is item:
                self._entries.remove(e)
                return True
        return False

    def expired(self, now: float, timeout_s: float) -> list[T]:
        """Remove and return the items that waited longer than ``timeout_s``."""
        old = [e for e in self._entries if now - e.since > timeout_s]
        for e in old:
            self._entries.remove(e)
        return [e.item for e in old]
