"""SWIM-style failure detector: a sans-IO protocol object.

Every period we ping each watched peer that has no probe in flight. No ack within
``ack_timeout``: we ask ``indirect_fanout`` other peers to ping it for us (``PingReq``), which tells a
dead peer apart from a bad link between two live ones. No ack through them within
``indirect_timeout``: the peer is :class:`Suspected`. If nothing from it arrives for
``suspicion_timeout`` more, it has :class:`Failed` and the gossip layer signs and floods a down
notice. Any message from a suspect (or an external ``alive`` signal) clears it: :class:`Recovered`.

The period is ``probe_interval`` (1 s), stretched so that we send at most ``probe_rate`` (4) pings a
second: ``watched / 4`` s past 4 watched peers. A node's cost is then the same at any mesh size, and
so is its detection time: a node is watched by W members (about log2(N) + 3), each pinging it once
per W / 4 s at its own phase, so the first ping after its death comes after about 1/4 s on average
(later than 1 s with odds of about e^-4, 2 %). Textbook SWIM pings one random member per period;
pinging every watched peer, each at its own phase, keeps the draw's tail short.

Default timings and the 5 s budget (no loss): first ping of the dead node ~0.25 s (rarely past 1 s),
direct timeout 0.3 s, indirect timeout 0.4 s (two hops), suspicion 1 s (a suspect is pinged again
every 250 ms meanwhile, directly and through one other peer, a different one each time, so a peer that
was only slow, or behind a bad path of ours, gets four chances to answer): down notice about
2-2.7 s after death; the flood then crosses the connection graph (diameter ~ log N / log(view size)
hops, 3 at 1,000 nodes) in well under 1 s of WAN latency. The rest absorbs lost probes and loaded
event loops.

**Local health** (Lifeguard's answer to a slow prober, Dadgar et al. 2018). A node whose own event
loop runs late (a loaded host) misses answers that did arrive, and a peer whose loop runs late answers
late: on a shared host both at once, and every false suspicion then costs refutations and floods that
load the host further, which is how a mesh of dozens of processes on two cores stayed in a flapping
state it could not leave. So each detector keeps a score, :attr:`FailureDetector.health` (0 to
:data:`~meshllm.mesh.messages.HEALTH_MAX`): up one for every tick that runs more than ``late_tick``
past its time, and up one for every suspicion of ours that the suspect then cleared by answering;
down one for every direct ack that arrives in time. Every probe message carries it. A wrong
suspicion is the better signal of the two: on a saturated host of 50 members most of them were raised
by detectors whose own ticks ran on time (the peer's loop was the late one), about 240 a second,
nearly all cleared within the suspicion timeout and the rest turned into false downs; a score raised
by them stretches the timeouts until suspicions stop being wrong.
Probing a peer, we stretch the ack, indirect and suspicion timeouts by ``1 + max(ours, the peer's last
reported score)``, and our probe period by ``1 + ours``: an overloaded node probes less and accuses
later, and an overloaded peer gets longer to answer. A healthy mesh (every score 0) keeps the timings
below; a peer can buy itself at most 9x the time to be found dead by claiming the top score.

**Verdicts wait for a loop that keeps time.** Stretching was not enough on that host: peers whose
loops were starved stayed silent for 10 to 35 s, past any stretched timeout, and the false downs kept
the host saturated. So a suspect whose suspicion timeout runs out while our own score is not 0 stays
suspect (rechecked, every ``recheck_interval`` stretched like the rest) until our score is 0 again,
or ``verdict_wait`` (60 s) has passed: a node that cannot keep time leaves verdicts to the watchers
that can, and every score of a healthy mesh is 0, so detection there is as fast as before. The wait
is bounded for a node left with no peer that answers (nothing could bring its score down). And a
tick that runs late restarts every suspicion's clock: a score back at 0 a moment later says our loop
keeps time now, not that it did while the suspect's answers were due (the 50-process churn run's
false downs came about one every 7 s).

The transport's own datagram liveness (3 missed probes 250 ms apart) comes in through
:meth:`FailureDetector.suspect` and :meth:`FailureDetector.alive`.

A peer gets answers at a bounded rate: pings and ping requests beyond :data:`PROBES_PER_S` per peer
(bursts of :data:`PROBE_BURST`) are dropped and reported as an :class:`Overstep`, and at most
:data:`RELAYS_PER_PEER` ping requests per peer are in flight, so a member cannot use us to flood
another one with pings.
"""

from __future__ import annotations

import math
import random
from collections.abc import Collection
from dataclasses import dataclass, field

from meshllm.mesh.messages import HEALTH_MAX, Ack, MeshMessage, Ping, PingReq
from meshllm.net.limits import RateLimit

PROBES_PER_S = 10.0
"""Pings plus ping requests one peer may send us per second (an honest one sends about 2-4)."""
PROBE_BURST = 20.0
RELAYS_PER_PEER = 8
"""Ping requests from one peer that we relay at once."""
RELAYS_MAX = 256


@dataclass(frozen=True)
class FailureConfig:
    """Probe timings (seconds); see the module docstring for how they add up to the 5 s target."""

    probe_interval: float = 1.0
    probe_rate: float = 4.0
    """Pings a second at most: with more than 4 watched peers the period stretches to ``watched / 4`` s."""
    ack_timeout: float = 0.3
    indirect_timeout: float = 0.4
    indirect_fanout: int = 2
    suspicion_timeout: float = 1.0
    recheck_interval: float = 0.25
    """A suspect is pinged this often (directly and through one other peer) until it answers or fails: a
    peer that was only slow gets four chances to clear itself within the suspicion timeout, not one."""
    late_tick: float = 0.15
    """A tick this far past its time says our own loop is overloaded (local health goes up one)."""
    verdict_wait: float = 60.0
    """A verdict due while our own health is not 0 waits for it to be 0 again, at most this long."""


@dataclass(frozen=True, slots=True)
class Probe:
    """Send ``message`` to ``to`` (a datagram is fine: loss is what the detector tolerates)."""

    to: str
    message: MeshMessage


@dataclass(frozen=True, slots=True)
class Suspected:
    """``node_id`` failed a direct and an indirect probe (or the transport said so)."""

    node_id: str


@dataclass(frozen=True, slots=True)
class Recovered:
    """A suspected ``node_id`` answered again."""

    node_id: str


@dataclass(frozen=True, slots=True)
class Failed:
    """``node_id`` stayed silent through the suspicion timeout: declare it down."""

    node_id: str


@dataclass(frozen=True, slots=True)
class Overstep:
    """``peer`` sent more than a limit allows; what it sent was dropped (the driver counts a strike)."""

    peer: str
    reason: str


DetectorEvent = Suspected | Recovered | Failed


@dataclass(slots=True)
class _Pending:
    nonce: int
    deadline: float
    indirect: bool = False
    helpers: frozenset[str] = field(default_factory=frozenset)
    """Peers we sent a PingReq for this probe: the only ones besides the target whose Ack counts."""


@dataclass(frozen=True, slots=True)
class _Relay:
    requester: str
    target: str
    nonce: int
    deadline: float


class FailureDetector:
    """Probe state for the peers the driver says we are connected to."""

    def __init__(self, rng: random.Random, now: float, config: FailureConfig | None = None) -> None:
        self.config = config or FailureConfig()
        self._rng = rng
        self._pending: dict[str, _Pending] = {}
        self._by_nonce: dict[int, str] = {}
        self._relays: dict[int, _Relay] = {}
        self._suspects: dict[str, tuple[float, float]] = {}
        """suspect -> (when it fails unless heard from, that time as first set: the verdict wait counts from it)"""
        self._peer_health: dict[str, int] = {}
        self.health = 0
        """Our local-health score (module docstring): 0 while our loop keeps time."""
        self._due = math.inf
        """When the last tick asked to run next (how late a tick runs is our loop's health)."""
        self._next_probe = now
        self._next_recheck = now
        self._rate: RateLimit[str] = RateLimit(PROBES_PER_S, PROBE_BURST)

    @property
    def suspects(self) -> frozenset[str]:
        return frozenset(self._suspects)

    def next_timer(self) -> float:
        """When :meth:`tick` next has work."""
        soonest = self._next_probe
        for pending in self._pending.values():
            soonest = min(soonest, pending.deadline)
        for deadlines in self._suspects.values():
            soonest = min(soonest, self._verdict_due(*deadlines), self._next_recheck)
        return soonest

    def stretch(self, node: str) -> int:
        """How many times its base timeouts a probe of ``node`` waits (1 while both ends are healthy)."""
        return 1 + max(self.health, self._peer_health.get(node, 0))

    def tick(self, now: float, targets: Collection[str]) -> list[Probe | DetectorEvent]:
        """Advance timers; ``targets`` are the peers we hold connections to now."""
        out: list[Probe | DetectorEvent] = []
        if now - self._due > self.config.late_tick:
            self.health = min(HEALTH_MAX, self.health + 1)
            # The acks we missed meanwhile may have been waiting for our loop: every suspect gets a whole
            # suspicion timeout from now, as if suspected now.
            for node, (deadline, first) in self._suspects.items():
                self._suspects[node] = max(deadline, now + self.config.suspicion_timeout * self.stretch(node)), first
        for node, deadlines in sorted(self._suspects.items()):
            if now >= self._verdict_due(*deadlines):
                self.forget(node)
                out.append(Failed(node))
        for node, pending in sorted(self._pending.items()):
            if now < pending.deadline:
                continue
            if not pending.indirect:
                out += self._go_indirect(node, pending, now, targets)
            else:
                self._drop(node)
                out += self._suspect(node, now)
        self._relays = {n: r for n, r in self._relays.items() if r.deadline > now}
        if now >= self._next_probe:
            period = max(self.config.probe_interval, len(targets) / self.config.probe_rate)
            self._next_probe = now + period * (1 + self.health)
            watched = set(targets)
            self._peer_health = {n: h for n, h in self._peer_health.items() if n in watched}  # bounded
            for node in sorted(targets):
                if node not in self._pending:
                    out.append(Probe(node, Ping(self._start(node, now), self.health)))
        if now >= self._next_recheck:
            self._next_recheck = now + self.config.recheck_interval * (1 + self.health)
            for node in sorted(self._suspects):
                if node in targets and node not in self._pending:
                    nonce = self._start(node, now)
                    pending = self._pending[node]  # a recheck: lasts until the next, and no answer only ends it
                    pending.indirect, pending.deadline = True, self._next_recheck
                    out.append(Probe(node, Ping(nonce, self.health)))
                    # and through one other peer, a different one each time: a path of ours that drops
                    # datagrams (a congested connection) must not be what condemns a live peer
                    helpers = sorted(t for t in targets if t != node)
                    if helpers:
                        helper = self._rng.choice(helpers)
                        pending.helpers = frozenset([helper])
                        out.append(Probe(helper, PingReq(nonce, node)))
        self._rearm(now)
        return out

    def receive(self, source: str, message: MeshMessage, now: float) -> list[Probe | DetectorEvent | Overstep]:
        """Handle a Ping, Ack or PingReq from ``source``."""
        out: list[Probe | DetectorEvent | Overstep] = list(self._heard(source))
        if isinstance(message, Ping | PingReq) and not self._rate.allow(source, now):
            return [*out, Overstep(source, "more probes than the detector answers")]
        if isinstance(message, Ping):
            self._peer_health[source] = message.health
            out.append(Probe(source, Ack(message.nonce, self.health)))
        elif isinstance(message, PingReq):
            relayed = sum(1 for r in self._relays.values() if r.requester == source)
            if relayed >= RELAYS_PER_PEER or len(self._relays) >= RELAYS_MAX or message.target == source:
                return out
            nonce = self._new_nonce()
            deadline = now + self.config.indirect_timeout
            self._relays[nonce] = _Relay(source, message.target, message.nonce, deadline)
            out.append(Probe(message.target, Ping(nonce, self.health)))
        elif isinstance(message, Ack):
            # Nonces are random, but an Ack still counts only from whoever could honestly send it:
            # the pinged node itself, or a helper we asked to ping it for us.
            relay = self._relays.get(message.nonce)
            if relay is not None and source == relay.target:
                del self._relays[message.nonce]
                self._peer_health[source] = message.health
                out.append(Probe(relay.requester, Ack(relay.nonce, message.health)))
            target = self._by_nonce.get(message.nonce)
            pending = None if target is None else self._pending.get(target)
            if target is not None and pending is not None and (source == target or source in pending.helpers):
                if not pending.indirect and now <= pending.deadline:
                    self.health = max(0, self.health - 1)  # answered in time: our loop keeps up
                self._peer_health[target] = message.health  # its own, or relayed by a helper
                self._drop(target)
                self._rearm(now)
                out += self._heard(target)
        return out

    def suspect(self, node: str, now: float) -> list[Probe | DetectorEvent]:
        """External signal (transport liveness): start the suspicion clock now."""
        self._drop(node)
        return self._suspect(node, now)

    def alive(self, node: str) -> list[Probe | DetectorEvent]:
        """External signal: the peer is demonstrably alive."""
        return self._heard(node)

    def forget(self, node: str) -> None:
        """Drop all state about ``node`` (it was removed from the view)."""
        self._drop(node)
        self._suspects.pop(node, None)
        self._peer_health.pop(node, None)

    def _verdict_due(self, deadline: float, first: float) -> float:
        """When a suspect whose suspicion timeout ends at ``deadline`` (``first``, before late ticks moved it)
        fails: then, while our own loop keeps time; otherwise once it does again; and ``verdict_wait`` after
        ``first`` at the latest (module docstring)."""
        bound = first + self.config.verdict_wait
        return min(deadline, bound) if self.health == 0 else bound

    def _suspect(self, node: str, now: float) -> list[Probe | DetectorEvent]:
        if node in self._suspects:
            return []
        deadline = now + self.config.suspicion_timeout * self.stretch(node)
        self._suspects[node] = deadline, deadline
        return [Suspected(node)]

    def _heard(self, node: str) -> list[Probe | DetectorEvent]:
        if self._suspects.pop(node, None) is None:
            return []
        self.health = min(HEALTH_MAX, self.health + 1)  # it was alive: our timeouts were too short for now
        return [Recovered(node)]

    def _go_indirect(
        self, node: str, pending: _Pending, now: float, targets: Collection[str]
    ) -> list[Probe | DetectorEvent]:
        helpers = sorted(t for t in targets if t != node)
        helpers = self._rng.sample(helpers, min(self.config.indirect_fanout, len(helpers)))
        pending.indirect = True
        pending.helpers = frozenset(helpers)
        pending.deadline = now + self.config.indirect_timeout * self.stretch(node)
        # A second direct ping too: one lost datagram should not be enough to suspect.
        out: list[Probe | DetectorEvent] = [Probe(node, Ping(pending.nonce, self.health))]
        return out + [Probe(h, PingReq(pending.nonce, node)) for h in helpers]

    def _rearm(self, now: float) -> None:
        """Note when the driver should tick next; a timer already past is due now, not late."""
        self._due = max(now, self.next_timer())

    def _start(self, node: str, now: float) -> int:
        nonce = self._new_nonce()
        self._pending[node] = _Pending(nonce, now + self.config.ack_timeout * self.stretch(node))
        self._by_nonce[nonce] = node
        return nonce

    def _drop(self, node: str) -> None:
        pending = self._pending.pop(node, None)
        if pending is not None:
            self._by_nonce.pop(pending.nonce, None)

    def _new_nonce(self) -> int:
        """An unpredictable nonce (62 random bits), unique among those in flight."""
        while True:
            nonce = self._rng.getrandbits(62)
            if nonce not in self._by_nonce and nonce not in self._relays:
                return nonce
