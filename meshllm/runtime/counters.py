"""Request counters for ``/api/status``: totals and a per-minute rate (sans-IO: ``now`` is passed in)."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

WINDOW_S = 60.0


@dataclass
class RequestCounters:
    """Requests this node's API handled: how many, how many failed, how many in the last minute."""

    total: int = 0
    failed: int = 0
    remote: int = 0
    """Requests this node's API sent to a peer."""
    served_for_peers: int = 0
    """Requests peers sent to this node's engines over the tunnel."""
    replays: int = 0
    """Replays this node started for generations whose serving node failed (or stalled: hedges) mid-answer."""
    replays_failed: int = 0
    """Replays that found no node to continue on in time (the client got the error)."""
    replays_impossible: int = 0
    """Generations that broke mid-answer with no other node serving their model."""
    replays_dropped: int = 0
    """Hedges (replays started on a stall) dropped because the first node answered first."""
    failovers: int = 0
    """Targets skipped because they failed before their first byte (the request went on to the next)."""
    _recent: deque[float] = field(default_factory=deque)

    def started(self, now: float, *, remote: bool = False) -> None:
        """A request arrived (``remote``: it is routed to a peer)."""
        self.total += 1
        self.remote += remote
        self._recent.append(now)
        self._trim(now)

    def failed_one(self) -> None:
        """A request ended in an error (before or after its first byte)."""
        self.failed += 1

    def per_minute(self, now: float) -> float:
        """Requests started in the last 60 s."""
        self._trim(now)
        return float(len(self._recent))

    def snapshot(self, now: float) -> dict[str, Any]:
        """The ``requests`` object of ``/api/status``."""
        return {"total": self.total, "failed": self.failed, "per_min": self.per_minute(now),
                "remote": self.remote, "served_for_peers": self.served_for_peers,
                "replays": self.replays, "replays_failed": self.replays_failed,
                "replays_impossible": self.replays_impossible, "replays_dropped": self.replays_dropped,
                "failovers": self.failovers}

    def _trim(self, now: float) -> None:
        while self._recent and self._recent[0] <= now - WINDOW_S:
            self._recent.popleft()
