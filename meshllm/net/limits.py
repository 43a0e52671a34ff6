"""Per-peer limits as small sans-IO objects: rate buckets, strike counts and cool-downs.

A hostile peer is answered the same way wherever it oversteps: what it sent beyond a limit is
dropped, each overstep is a *strike*, and a peer with :data:`STRIKES_TO_COOL_DOWN` strikes inside
:data:`STRIKE_WINDOW_S` is cut off and refused for :data:`COOL_DOWN_S` (the endpoint closes its
connection and turns its dials and handshakes away). Every table here is bounded, so a flood of
peer ids cannot grow them either. ``now`` is always passed in (monotonic seconds).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Generic, TypeVar

K = TypeVar("K")

STRIKES_TO_COOL_DOWN = 3
STRIKE_WINDOW_S = 60.0
COOL_DOWN_S = 60.0
TABLE_MAX = 4096
"""Entries any one table keeps; the least recently touched goes first."""


class _Bounded(Generic[K]):
    """An LRU dict of at most ``size`` entries."""

    def __init__(self, size: int) -> None:
        self._size = size
        self.items: OrderedDict[K, object] = OrderedDict()

    def get(self, key: K) -> object | None:
        value = self.items.get(key)
        if value is not None:
            self.items.move_to_end(key)
        return value

    def put(self, key: K, value: object) -> None:
        self.items[key] = value
        self.items.move_to_end(key)
        while len(self.items) > self._size:
            self.items.popitem(last=False)

    def pop(self, key: K) -> None:
        self.items.pop(key, None)


class RateLimit(Generic[K]):
    """A token bucket per key: ``rate`` events a second on average, bursts of ``burst``."""

    def __init__(self, rate: float, burst: float, size: int = TABLE_MAX) -> None:
        if rate <= 0 or burst < 1:
            raise ValueError("a rate limit needs rate > 0 and burst >= 1")
        self.rate, self.burst = rate, burst
        self._buckets: _Bounded[K] = _Bounded(size)

    def allow(self, key: K, now: float) -> bool:
        """Take one token for ``key``; False (and nothing taken) when its bucket is empty."""
        state = self._buckets.get(key)
        tokens, last = state if isinstance(state, tuple) else (self.burst, now)
        tokens = min(self.burst, tokens + max(0.0, now - last) * self.rate)
        if tokens < 1.0:
            self._buckets.put(key, (tokens, now))
            return False
        self._buckets.put(key, (tokens - 1.0, now))
        return True


class Strikes(Generic[K]):
    """Counts misbehaviour per key over a sliding window."""

    def __init__(self, limit: int = STRIKES_TO_COOL_DOWN, window_s: float = STRIKE_WINDOW_S,
                 size: int = TABLE_MAX) -> None:
        self.limit, self.window_s = limit, window_s
        self._times: _Bounded[K] = _Bounded(size)

    def add(self, key: K, now: float) -> bool:
        """Record one strike; True when ``key`` has reached the limit (its count then restarts)."""
        previous = self._times.get(key)
        times = [t for t in (previous if isinstance(previous, list) else []) if now - t < self.window_s]
        times.append(now)
        if len(times) >= self.limit:
            self._times.pop(key)
            return True
        self._times.put(key, times[-self.limit:])
        return False


class CoolDowns(Generic[K]):
    """Keys refused until a deadline."""

    def __init__(self, size: int = TABLE_MAX) -> None:
        self._until: _Bounded[K] = _Bounded(size)

    def add(self, key: K, now: float, seconds: float = COOL_DOWN_S) -> None:
        self._until.put(key, now + seconds)

    def remaining(self, key: K, now: float) -> float:
        """Seconds ``key`` stays refused (0.0: not cooling down)."""
        until = self._until.items.get(key)
        if not isinstance(until, float):
            return 0.0
        if until <= now:
            self._until.pop(key)
            return 0.0
        return until - now


class ByteRate:
    """One byte budget shared by every sender that books from it: ``rate`` bytes a second on average,
    bursts of ``burst`` bytes.

    :meth:`reserve` books the bytes at once and returns how long the caller must wait before sending
    them. Bookings go into debt rather than failing, so senders are served in the order they booked
    and the long-run rate holds however many share the budget.
    """

    def __init__(self, rate: float, burst: float) -> None:
        if rate <= 0 or burst <= 0:
            raise ValueError("a byte rate needs rate > 0 and burst > 0")
        self.rate, self.burst = rate, burst
        self._tokens = burst
        self._last: float | None = None

    def reserve(self, n: int, now: float) -> float:
        """Book ``n`` bytes; seconds to wait before sending them (0.0: send now)."""
        if self._last is not None:
            self._tokens = min(self.burst, self._tokens + max(0.0, now - self._last) * self.rate)
        self._last = now
        self._tokens -= n
        return 0.0 if self._tokens >= 0 else -self._tokens / self.rate
