"""Relaying (sans-IO core): reservations, circuits and their limits, and the relay wire messages.

A node behind a NAT that filters unsolicited packets cannot be dialed. It *reserves* a slot at a
reachable member (the relay); another member then asks the relay for a *circuit* to it. A circuit
is a pair of ``relay`` streams (dialer <-> relay <-> target) whose frames are whole QUIC packets of
an ordinary end-to-end connection between the two members, so the relay moves ciphertext it cannot
read or alter undetected (like TURN or DERP). Relays only join peers that are both admitted
members (they are connected to it), never strangers.

Limits bound what one member can make a relay carry: reservations expire unless refreshed, each
circuit ends after ``circuit_bytes`` or ``circuit_seconds`` (the members then redial or, better,
have already punched a direct path), and each member holds at most ``circuits_per_peer``.

Wire (first frame of a ``relay`` stream, then raw packets as msgpack ``bin`` frames)::

    member -> relay   Reserve{}                 relay -> member  Reserved{ttl_s, ...} | Refused{reason}
    dialer -> relay   ConnectTo{target}         relay -> target  Incoming{source}
    target -> relay   Accept{} | Refused        relay -> dialer  Accept{}  | Refused{reason}
"""

from __future__ import annotations

from dataclasses import dataclass, field

import msgspec

RELAY_STREAM = "relay"
"""Stream kind of reservations and circuits."""


class Reserve(msgspec.Struct, tag="reserve", frozen=True):
    """Member -> relay: keep a slot so others can reach me through you."""


class Reserved(msgspec.Struct, tag="reserved", frozen=True):
    """Relay -> member: the reservation holds for ``ttl_s`` (refresh before) with these limits."""

    ttl_s: float
    circuit_bytes: int
    circuit_seconds: float


class ConnectTo(msgspec.Struct, tag="connect", frozen=True):
    """Dialer -> relay: open a circuit to ``target`` (a node id holding a reservation)."""

    target: str


class Incoming(msgspec.Struct, tag="incoming", frozen=True):
    """Relay -> target: ``source`` asks for a circuit to you."""

    source: str


class Accept(msgspec.Struct, tag="accept", frozen=True):
    """The circuit is open; packets follow."""


class Refused(msgspec.Struct, tag="refused", frozen=True):
    reason: str


RelayMessage = Reserve | Reserved | ConnectTo | Incoming | Accept | Refused


@dataclass(frozen=True)
class RelayLimits:
    """What a relay grants; defaults suit inference traffic (small frames, long sessions)."""

    max_reservations: int = 128
    reservation_ttl_s: float = 60.0
    circuits_per_peer: int = 16
    """Most open circuits one member may take part in (as dialer or target)."""
    circuit_bytes: int = 1 << 30
    """Bytes (both directions) after which a circuit is closed."""
    circuit_seconds: float = 3600.0
    """Age after which a circuit is closed."""


@dataclass
class Circuit:
    """One open circuit, for accounting."""

    id: int
    source: str
    target: str
    opened: float
    bytes: int = 0


@dataclass
class RelayBook:
    """The relay's state: who holds a reservation, which circuits are open, what they used.

    Pure bookkeeping with an injected clock: the driver asks before acting and reports traffic.
    Every refusal is a reason string the driver sends back as :class:`Refused`.
    """

    limits: RelayLimits = field(default_factory=RelayLimits)
    reservations: dict[str, float] = field(default_factory=dict)
    """node id -> expiry time."""
    circuits: dict[int, Circuit] = field(default_factory=dict)
    _next_id: int = 0

    def reserve(self, peer: str, now: float) -> Reserved | Refused:
        """Grant or refresh ``peer``'s reservation."""
        self.expire(now)
        if peer not in self.reservations and len(self.reservations) >= self.limits.max_reservations:
            return Refused("relay is full")
        self.reservations[peer] = now + self.limits.reservation_ttl_s
        return Reserved(self.limits.reservation_ttl_s, self.limits.circuit_bytes, self.limits.circuit_seconds)

    def release(self, peer: str) -> None:
        """``peer`` disconnected: drop its reservation (its circuits' streams die with it)."""
        self.reservations.pop(peer, None)

    def open(self, source: str, target: str, now: float) -> Circuit | Refused:
        """Admit a circuit from ``source`` to ``target`` (which must hold a live reservation)."""
        self.expire(now)
        if source == target:
            return Refused("cannot relay to yourself")
        if target not in self.reservations:
            return Refused(f"{target[:8]} holds no reservation here")
        for peer in (source, target):
            if sum(peer in (c.source, c.target) for c in self.circuits.values()) >= self.limits.circuits_per_peer:
                return Refused(f"{peer[:8]} has too many circuits")
        self._next_id += 1
        circuit = Circuit(self._next_id, source, target, now)
        self.circuits[circuit.id] = circuit
        return circuit

    def carry(self, circuit_id: int, nbytes: int, now: float) -> str | None:
        """Account ``nbytes`` forwarded on a circuit; a reason string when it must close now."""
        circuit = self.circuits.get(circuit_id)
        if circuit is None:
            return "circuit closed"
        circuit.bytes += nbytes
        if circuit.bytes > self.limits.circuit_bytes:
            return f"circuit exceeded {self.limits.circuit_bytes} bytes"
        if now - circuit.opened > self.limits.circuit_seconds:
            return f"circuit exceeded {self.limits.circuit_seconds:.0f} s"
        return None

    def close(self, circuit_id: int) -> None:
        self.circuits.pop(circuit_id, None)

    def expire(self, now: float) -> None:
        """Forget reservations that were not refreshed in time (their circuits stay until limits)."""
        for peer in [p for p, until in self.reservations.items() if until <= now]:
            del self.reservations[peer]
