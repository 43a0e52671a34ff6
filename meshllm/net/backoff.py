"""Reconnect policy: exponential backoff with jitter (sans-IO), and a deadline-bound dial loop."""

from __future__ import annotations

import asyncio
import math
import random
from typing import TYPE_CHECKING

from meshllm.net.errors import ConnectError, ConnectTimeout
from meshllm.net.messages import Addr

if TYPE_CHECKING:
    from meshllm.net.connection import PeerConnection
    from meshllm.net.endpoint import Endpoint


MAX_ATTEMPTS = 1 << 16
"""Failed attempts counted (the delay is long capped by then)."""


class Backoff:
    """Delays ``initial * factor**n`` capped at ``maximum``, each scaled by a random factor.

    The jitter (a uniform draw in ``[1 - jitter, 1]``) keeps peers that lost each other at the
    same moment from redialling in lockstep.
    """

    def __init__(
        self,
        initial: float = 0.1,
        factor: float = 2.0,
        maximum: float = 5.0,
        jitter: float = 0.5,
        rng: random.Random | None = None,
    ) -> None:
        if not (initial > 0 and factor >= 1 and maximum >= initial and 0 <= jitter <= 1):
            raise ValueError("backoff needs initial > 0, factor >= 1, maximum >= initial, 0 <= jitter <= 1")
        self.initial, self.factor, self.maximum, self.jitter = initial, factor, maximum, jitter
        self.attempts = 0
        self._rng = rng or random.Random()

    def next_delay(self) -> float:
        """The delay before the next attempt; each call counts one failed attempt.

        A peer decides how often our dials fail, so the count is never raised to a power uncapped:
        once the delay reaches ``maximum`` it stops growing (``factor**n`` would overflow a float
        past about a thousand failures).
        """
        steps = self.attempts
        if self.factor > 1:  # past this many steps the cap holds anyway
            steps = min(steps, math.ceil(math.log(self.maximum / self.initial, self.factor)))
        base = min(self.maximum, self.initial * self.factor**steps)
        self.attempts = min(self.attempts + 1, MAX_ATTEMPTS)
        return base * (1 - self.jitter * self._rng.random())

    def reset(self) -> None:
        """Start over after a success."""
        self.attempts = 0


async def dial_with_retry(
    endpoint: Endpoint,
    addr: Addr,
    *,
    expected_node_id: str | None = None,
    deadline: float = 30.0,
    attempt_timeout: float = 5.0,
    backoff: Backoff | None = None,
) -> PeerConnection:
    """Dial until admitted or ``deadline`` seconds have passed; raises the last error then.

    Permanent refusals (:class:`AdmissionRefused`, :class:`PeerMismatch`) are raised at once.
    """
    loop = asyncio.get_running_loop()
    end = loop.time() + deadline
    policy = backoff or Backoff()
    last: ConnectError | None = None
    while True:
        remaining = end - loop.time()
        if remaining <= 0:  # (a sleep that ended late, on a busy host, still reports what failed)
            raise last or ConnectTimeout(f"could not connect to {addr[0]}:{addr[1]} within {deadline:.1f}s")
        try:
            return await endpoint.connect(
                addr, expected_node_id=expected_node_id, timeout=min(attempt_timeout, remaining)
            )
        except ConnectError as exc:
            if exc.permanent:
                raise
            last = exc
            delay = policy.next_delay()
            if loop.time() + delay >= end:
                raise
            await asyncio.sleep(delay)
