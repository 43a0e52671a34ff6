"""Events the endpoint reports about its peers (for the mesh layer's peer table and status)."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class PeerEventKind(Enum):
    CONNECTED = "connected"
    """Admission finished both ways; streams can be opened."""
    SUSPECT = "suspect"
    """Several probes in a row went unanswered; the peer may be dead or cut off."""
    ALIVE = "alive"
    """A suspect peer answered a probe again."""
    UPGRADED = "upgraded"
    """A direct (or punched) connection replaced the peer's relayed one."""
    CLOSED = "closed"
    """The connection ended (either side closed it, or it timed out)."""


@dataclass(frozen=True, slots=True)
class PeerEvent:
    """A change in one peer's connection."""

    kind: PeerEventKind
    """What happened."""
    node_id: str
    """The peer's node id."""
    rtt_ms: float | None
    """Smoothed probe RTT at the time, if measured."""
    reason: str = ""
    """Why the connection closed (CLOSED only): the CONNECTION_CLOSE reason or a local cause."""
