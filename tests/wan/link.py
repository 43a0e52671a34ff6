"""One direction of an emulated WAN link, sans-IO: when a datagram leaves, or that it is lost.

A datagram offered at ``now`` first waits for the link to be free (the bandwidth cap serialises
datagrams one after another, like a router's output queue), then travels for the one-way delay,
give or take the jitter. It is dropped at random with probability ``loss``, and when the queue in
front of the cap already holds more than ``queue_ms`` of traffic (a tail drop, as a router whose
buffer is full). Departures never overtake each other: a datagram that drew a shorter delay than
the one ahead of it waits for it, so jitter varies latency without reordering (what a single path
does; QUIC copes with reordering, but measured RTTs should not depend on it).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field


@dataclass(frozen=True)
class LinkProfile:
    """What one direction of a link does to datagrams."""

    delay_ms: float = 0.0
    """One-way delay (a symmetric link of RTT ``r`` has ``r / 2`` each way)."""
    jitter_ms: float = 0.0
    """Each datagram's delay is drawn uniformly from ``delay_ms +- jitter_ms`` (never below zero)."""
    loss: float = 0.0
    """Probability that a datagram is dropped (independently of the others)."""
    bandwidth_mbps: float | None = None
    """Serialisation rate in megabits per second; None: unlimited."""
    queue_ms: float = 100.0
    """Most traffic (in milliseconds at the bandwidth cap) waiting in front of the cap before tail drops."""

    def __post_init__(self) -> None:
        if self.delay_ms < 0 or self.jitter_ms < 0 or self.queue_ms < 0:
            raise ValueError("delay, jitter and queue must not be negative")
        if not 0.0 <= self.loss < 1.0:
            raise ValueError(f"loss must be in [0, 1), got {self.loss}")
        if self.bandwidth_mbps is not None and self.bandwidth_mbps <= 0:
            raise ValueError("a bandwidth cap must be positive")

    @classmethod
    def rtt(cls, rtt_ms: float, **kw: float | None) -> LinkProfile:
        """One direction of a symmetric link with round-trip time ``rtt_ms``."""
        return cls(delay_ms=rtt_ms / 2.0, **kw)  # type: ignore[arg-type]


@dataclass
class LinkStats:
    """What one direction has carried so far."""

    sent: int = 0
    dropped_random: int = 0
    dropped_queue: int = 0
    bytes: int = 0


@dataclass
class LinkState:
    """The mutable side of one direction: the cap's busy time, the last departure, and counters."""

    profile: LinkProfile
    rng: random.Random = field(default_factory=random.Random)
    stats: LinkStats = field(default_factory=LinkStats)
    _free_at: float = 0.0
    _last_departure: float = 0.0

    def offer(self, now: float, size: int) -> float | None:
        """When a ``size``-byte datagram offered at ``now`` (seconds) leaves the link, or None if it is lost."""
        p = self.profile
        start = max(now, self._free_at)
        if p.bandwidth_mbps is not None:
            if (start - now) * 1000.0 > p.queue_ms + 1e-9:  # (float sums of serialisation times)
                self.stats.dropped_queue += 1
                return None
            self._free_at = start + size * 8 / (p.bandwidth_mbps * 1e6)
            start = self._free_at
        if p.loss and self.rng.random() < p.loss:
            self.stats.dropped_random += 1
            return None
        delay = p.delay_ms
        if p.jitter_ms:
            delay = max(0.0, delay + self.rng.uniform(-p.jitter_ms, p.jitter_ms))
        departure = max(start + delay / 1000.0, self._last_departure)
        self._last_departure = departure
        self.stats.sent += 1
        self.stats.bytes += size
        return departure
