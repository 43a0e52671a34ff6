"""NAT traversal decisions (sans-IO): am I reachable, and when to try punching to a relayed peer.

**Reachability.** Peers tell us where they see us (the admission exchange's ``observed``). If one
of them saw us at our own bound port on one of our own interface addresses, no NAT rewrote our
packets: we are reachable and may relay for others (``--relay auto``). If every observation
differs, a NAT sits in front of us: we reserve a slot at a relay and publish it. An announced
address (``--announce``, a port forward) counts as reachable.

**Punching** (like libp2p DCUtR). Two members that reached each other through a relay trade their
candidate addresses over that relayed connection, on a ``punch`` stream, and time a simultaneous
dial::

    initiator -- PunchConnect{addrs} --> responder        (initiator starts a clock)
    initiator <-- PunchConnect{addrs} -- responder        (initiator: rtt = clock)
    initiator -- PunchSync{} ---------> responder         responder starts sending junk
                                                          datagrams to the initiator's addresses;
                                                          initiator dials them after rtt / 2

Both send from the one socket they use for everything. The responder's junk opens its own NAT's
mapping (and conntrack entry) towards the initiator just as the initiator's QUIC Initial arrives,
which the responder's NAT then lets in as a reply; the initiator's Initial in turn opened the
initiator's NAT for the handshake's answers. Only the initiator dials, so exactly one direct
connection forms. With endpoint-independent mapping (most home NATs) this works; with a symmetric
NAT the mapping towards the peer has a port nobody could predict and the members stay relayed.
:class:`PunchSchedule` says when to try (again): attempts back off exponentially.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from enum import Enum
from typing import Annotated, Literal

import msgspec

from meshllm.net.backoff import Backoff
from meshllm.net.messages import Addr

PUNCH_STREAM = "punch"
RelayMode = Literal["on", "off", "auto"]
MAX_PUNCH_ADDRS = 8
"""Most candidate addresses one PunchConnect may carry (each is dialed or sprayed with junk)."""
MAX_PUNCH_ADDR_LEN = 64
"""Longest candidate ``host:port`` text (a bracketed IPv6 address and port fit easily)."""


class PunchConnect(msgspec.Struct, tag="punch-connect", frozen=True):
    """Our candidate addresses (``host:port``): observed (public) ones first, then listen ones."""

    addrs: Annotated[
        list[Annotated[str, msgspec.Meta(max_length=MAX_PUNCH_ADDR_LEN)]], msgspec.Meta(max_length=MAX_PUNCH_ADDRS)
    ]


class PunchSync(msgspec.Struct, tag="punch-sync", frozen=True):
    """Initiator -> responder: dial now."""


PunchMessage = PunchConnect | PunchSync


class Reachability(Enum):
    UNKNOWN = "unknown"
    """No peer has told us where it sees us yet."""
    PUBLIC = "public"
    """Peers reach us at our own address: no NAT in between (or a port forward we announced)."""
    PRIVATE = "private"
    """Every peer sees another address: we are behind a NAT."""


def reachability(
    bound_port: int, observed: Iterable[Addr], is_local: Callable[[str], bool], announced: bool = False
) -> Reachability:
    """Classify from the addresses peers observed us at; ``is_local(host)``: an interface of ours."""
    if announced:
        return Reachability.PUBLIC
    seen = [a for a in observed if is_ip(a[0])]
    if not seen:
        return Reachability.UNKNOWN
    if any(port == bound_port and is_local(host) for host, port in seen):
        return Reachability.PUBLIC
    return Reachability.PRIVATE


def serves_relay(mode: RelayMode, reach: Reachability) -> bool:
    """Whether we accept reservations: always (on), never (off), or when reachable (auto)."""
    return mode == "on" or (mode == "auto" and reach is Reachability.PUBLIC)


def is_ip(host: str) -> bool:
    """True for an IP literal (relayed connections use virtual, non-IP addresses)."""
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def sync_delay(rtt_s: float) -> float:
    """How long the initiator waits after PunchSync: the responder receives it half an RTT later."""
    return max(0.0, rtt_s / 2)


@dataclass
class _Peer:
    backoff: Backoff
    not_before: float = 0.0
    running: bool = False


@dataclass
class PunchSchedule:
    """When to attempt a punch to each relayed peer: at once, then with exponential backoff.

    The driver calls :meth:`due` with the peers it reaches only through a relay, :meth:`started`
    when it begins an attempt, and :meth:`finished` with the outcome. A success forgets the
    peer; if that direct path is lost later, the next relayed connection starts over.
    """

    initial: float = 1.0
    maximum: float = 60.0
    peers: dict[str, _Peer] = field(default_factory=dict)

    def due(self, relayed: Iterable[str], now: float) -> list[str]:
        """Relayed peers whose next attempt is due (peers no longer relayed are forgotten)."""
        current = set(relayed)
        for gone in [p for p in self.peers if p not in current and not self.peers[p].running]:
            del self.peers[gone]
        out = []
        for peer in sorted(current):
            state = self.peers.setdefault(peer, _Peer(Backoff(self.initial, 2.0, self.maximum, 0.25)))
            if not state.running and now >= state.not_before:
                out.append(peer)
        return out

    def started(self, peer: str) -> None:
        self.peers.setdefault(peer, _Peer(Backoff(self.initial, 2.0, self.maximum, 0.25))).running = True

    def next_in(self, peer: str, now: float) -> float | None:
        """Seconds until the next attempt to ``peer`` (0 while one runs or is due), or None when none is
        scheduled (the peer is not relayed, or only its end punches): what ``/api/status`` shows."""
        state = self.peers.get(peer)
        if state is None:
            return None
        return 0.0 if state.running else max(0.0, state.not_before - now)

    def finished(self, peer: str, ok: bool, now: float) -> None:
        state = self.peers.get(peer)
        if state is None:
            return
        if ok:
            del self.peers[peer]
            return
        state.running = False
        state.not_before = now + state.backoff.next_delay()
