"""Datagram probes (sans-IO): RTT as an EWMA, and liveness.

Every ``interval`` seconds a side sends ``PING nonce timestamp`` as a QUIC DATAGRAM (RFC 9221:
unreliable, never retransmitted, so a lost probe is a signal rather than a delay); the other
side echoes it as ``PONG`` (at most :data:`MAX_PONGS_PER_INTERVAL` per interval, so a peer
flooding pings cannot make us queue unbounded answers). A ping that has no pong by the time the
next one is due counts as missed, unless the connection delivered any packet since it left (the
driver passes when it last did: the peer's loop runs); ``suspect_after`` misses in a row
(3 x 250 ms) make the peer *suspect*, the next pong (or packet) makes it *alive* again. A late
pong still counts (for any of the last ``suspect_after`` pings): a peer whose answers take longer
than an interval (its loop or host is busy) is slow, not gone, and must not be taken for dead while
it answers. QUIC's idle timeout is far longer, so this is how a killed peer is noticed within about
a second. The caller passes ``now`` (seconds, monotonic) in.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from enum import Enum

PING = 1
PONG = 2
_PROBE = struct.Struct(">BQd")
"""type (u8), nonce (u64), sender's timestamp (f64 seconds) — 17 bytes."""
MAX_PONGS_PER_INTERVAL = 4
"""Pings answered per ``interval``; an honest peer sends one, the rest are dropped unanswered."""


def is_probe(data: bytes) -> bool:
    """Whether a datagram is a probe's: its first byte is PING or PONG. Other datagrams on a connection are
    the application's (the failure detector's msgpack maps, which never start with 1 or 2)."""
    return data[:1] in (b"\x01", b"\x02")


class Liveness(Enum):
    ALIVE = "alive"
    SUSPECT = "suspect"


@dataclass(frozen=True, slots=True)
class LivenessChanged:
    """The peer changed liveness state."""

    state: Liveness
    """The new state."""
    rtt_ms: float | None
    """Smoothed RTT at the time of the change (None before the first pong)."""


@dataclass(slots=True)
class ProbeOutput:
    """What one call asks the driver to do."""

    datagrams: list[bytes]
    """Datagrams to send now, in order."""
    events: list[LivenessChanged]
    """State changes to report."""


class ProbeState:
    """Probe scheduling, RTT estimation and liveness for one peer."""

    def __init__(
        self, now: float, *, interval: float = 0.25, suspect_after: int = 3, alpha: float = 0.2
    ) -> None:
        self.interval = interval
        self.suspect_after = suspect_after
        self.alpha = alpha
        self.state = Liveness.ALIVE
        self.rtt_ms: float | None = None
        """Smoothed round-trip time; None until the first pong."""
        self.missed = 0
        """Probes in a row that went unanswered."""
        self._next_ping = now
        self._outstanding: dict[int, float] = {}
        """Unanswered pings (at most ``suspect_after``, oldest first): nonce -> when sent."""
        self._last: int | None = None
        self._answer_interval = interval
        """Pongs are rationed per this, the pace we were made with: :meth:`pace` may slow our pings, but a
        peer with work on the connection pings at its full pace and must get every answer."""
        self._pong_window = now
        self._pongs = 0

    @property
    def next_deadline(self) -> float:
        """When :meth:`poll` next has work to do."""
        return self._next_ping

    def poll(self, now: float, heard_at: float | None = None) -> ProbeOutput:
        """Send a ping when one is due; count the previous one as missed if still unanswered.

        ``heard_at`` is when the connection last delivered a packet of any kind (stream data, ACKs). A ping
        left unanswered while the peer's packets kept arriving is not missed: they were sent by the loop
        that answers pings, so the pong is late or lost behind them, and the peer is alive (a suspect one
        is alive again). A peer that streams an answer to us while its pongs queue behind the data
        would otherwise turn suspect, and every request in flight to it is abandoned then.
        """
        out = ProbeOutput([], [])
        if now < self._next_ping:
            return out
        if self._last in self._outstanding:
            if heard_at is not None and heard_at >= self._outstanding[self._last]:
                self.missed = 0
                if self.state is Liveness.SUSPECT:
                    self.state = Liveness.ALIVE
                    out.events.append(LivenessChanged(Liveness.ALIVE, self.rtt_ms))
            else:
                self.missed += 1
                if self.missed >= self.suspect_after and self.state is Liveness.ALIVE:
                    self.state = Liveness.SUSPECT
                    out.events.append(LivenessChanged(Liveness.SUSPECT, self.rtt_ms))
        while len(self._outstanding) >= self.suspect_after:  # the oldest ping's pong no longer counts
            del self._outstanding[next(iter(self._outstanding))]
        nonce = self._last = int.from_bytes(os.urandom(8), "big")
        self._outstanding[nonce] = now
        out.datagrams.append(_PROBE.pack(PING, nonce, now))
        self._next_ping = now + self.interval
        return out

    def pace(self, interval: float, now: float) -> None:
        """Probe every ``interval`` from now on (the driver's pace changed, or probing paused and resumes):
        the next ping goes out now, and pings sent before count as neither answered nor missed."""
        self.interval = interval
        self._next_ping = now
        self._outstanding.clear()
        self._last = None

    def receive(self, data: bytes, now: float) -> ProbeOutput:
        """Handle a probe datagram: answer pings, measure pongs. Other bytes are ignored."""
        out = ProbeOutput([], [])
        if len(data) != _PROBE.size:
            return out
        kind, nonce, stamp = _PROBE.unpack(data)
        if kind == PING:
            if now >= self._pong_window + self._answer_interval:
                self._pong_window, self._pongs = now, 0
            if self._pongs < MAX_PONGS_PER_INTERVAL:
                self._pongs += 1
                out.datagrams.append(_PROBE.pack(PONG, nonce, stamp))
        elif kind == PONG and (sent := self._outstanding.pop(nonce, None)) is not None:
            sample = (now - sent) * 1000.0
            self.rtt_ms = sample if self.rtt_ms is None else (1 - self.alpha) * self.rtt_ms + self.alpha * sample
            self.missed = 0
            if self.state is Liveness.SUSPECT:
                self.state = Liveness.ALIVE
                out.events.append(LivenessChanged(Liveness.ALIVE, self.rtt_ms))
        return out
