"""Push-pull anti-entropy over signed peer records: a sans-IO protocol object (h11 style).

:class:`Gossip` owns our own record and the verified records of everyone else (a
:class:`~meshllm.mesh.view.ViewState`). The driver feeds it time, transport events and received
messages; it returns :class:`Send` instructions and events, and never touches a socket or a clock.

Three paths spread information, each sending a record to a peer at most once per change.
*Pushing*: a record we store because it changed is forwarded at once to :attr:`GossipConfig.push_fanout`
random connected peers (our own changes to every connected peer), so a change crosses the mesh in a
few network hops. A refresh (the same record re-signed) is not forwarded: nothing waits for it, and
anti-entropy delivers it with fewer copies (in an idle mesh of 50, forwarding refreshes had each member
receive about six records for every new one, on a stream each: a third of its packets).
*Flooding*: membership changes (a down notice, a leaving record, a record that
revives a peer) go to every connected peer at once, because missing the 5-second removal target on a
large mesh is not an option. *Anti-entropy* repairs whatever pushing missed: every round (1 s, the
same at any mesh size) we send k=2 random connected peers a :class:`Summary` of our table, one 8-byte
sum per bucket of node ids (:class:`~meshllm.mesh.view.Table`, 16 buckets); a peer answers with the
sums of the differing buckets' sub-buckets while they are big, then with a digest ``{node_id: seq}``
of only the buckets whose sums differ, and the usual exchange follows. A converged
mesh trades summaries and nothing else: no record is resent because a timer fired.

*Liveness is local, not gossiped.* There are no heartbeats: an unchanged record is not resent
because a timer fired. Each node probes the peers it chose to connect to (:meth:`Gossip.watched`,
the SWIM detector in ``failure.py``), so a death is seen by the ~log2 N nodes that hold it in their
partial view within about two seconds; the one who sees it first signs a down notice and floods it
to its connections, and anti-entropy hands it to any peer whose summary still counts the node alive
(a bucket's sum covers each record's alive bit). Every view drops a killed node in about the
detector's time plus a few network hops, whatever the mesh size.

*Refreshes* bound how long a signed copy circulates (a record older than ``records.max_age`` is
refused, so a replay cannot revive a node once its tombstone is gone). A node re-signs an unchanged
record every :meth:`GossipConfig.refresh_for` seconds: 30 s in a small mesh, stretched so the whole
mesh re-signs at most :attr:`GossipConfig.refresh_rate` records a second (each member's cost is then
the same at any size), and pushes the refresh to a few peers rather than flooding it. The record
says how long it may wait (``refresh``), and members stretch its age limit and the silence
backstop (``view.deadline``) by as much; the backstop matters only for a node nobody probes.

*Revocations* (records signed by the mesh key, verified by an injected callback) are kept for the
life of the node, flooded once when new and sent to every newly connected peer, so a late joiner
learns them too. A revoked peer becomes a ``revoked`` tombstone (``PeerRemoved``, reason
``revoked``) and its records are refused from then on.

*Down notices cannot be weaponised* (docs/identity.md, threat model). A notice counts only for the
exact sequence we hold for its subject (so the subject can always refute it with the next one),
only while it is fresh (:data:`NOTICE_TTL_S`), at most :data:`NOTICES_PER_S` per accuser, and never
while our own probes find the subject alive (we watch it). A notice about a node that is
demonstrably alive is *refuted*; an accuser refuted :data:`REFUTED_TO_BAN` times in a minute may
not accuse anyone for :data:`ACCUSER_BAN_S`.

*Every peer gets a bounded share of our work.* Digests and ``want`` lists (each costs us a copy of
our table) are answered at most :data:`PULLS_PER_S` times a second per peer; ``want`` lists and
the records verified per message are capped; a record refused for its membership is not asked for
again for :data:`REFUSED_MEMO_S`. What exceeds a limit is dropped and reported as an
:class:`~meshllm.mesh.failure.Overstep`, which the driver counts against the peer's connection.
"""

from __future__ import annotations

import math
import random
import struct
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Literal, Protocol

import msgspec
from nacl.signing import SigningKey

from meshllm.errors import (
    BadSignature,
    DecodeError,
    MeshllmError,
    Revoked,
    VerificationError,
    WrongDomain,
    WrongSigner,
)
from meshllm.identity.signing import CLOCK_SKEW_S
from meshllm.mesh import rtt, view
from meshllm.mesh.admission import vouching_member
from meshllm.mesh.failure import Failed, Overstep, Recovered, Suspected
from meshllm.mesh.messages import (
    REVOCATION_MAX,
    REVOCATIONS_PER_MESSAGE,
    Digest,
    DownNotice,
    Exchange,
    MeshMessage,
    Notices,
    Revocations,
    Summary,
    sign_notice,
    verify_notice,
)
from meshllm.mesh.records import (
    REFRESH_MAX_S,
    REFRESH_S,
    PathKind,
    PeerRecord,
    RecordVerifier,
    StaleRecord,
    decode_record,
    sign_record,
)
from meshllm.net.limits import CoolDowns, RateLimit, Strikes

EXCHANGE_BUDGET = 1024 * 1024
"""Bytes of records per Exchange message, well under the 8 MiB control-frame cap."""
ITEMS_SLACK = 16
"""Records (or notices) one message may carry beyond the number of peers we hold."""
ITEMS_MAX = 256
"""Hard cap on records (or notices) verified per message: bounds the signature checks one peer can
make us run per message. Anything beyond is ignored; anti-entropy asks for it again next round."""
WANT_MAX = ITEMS_MAX
"""Ids we ask one peer for in one answer (the rest wait for the next round)."""
PULLS_PER_S = 4.0
"""Digests and ``want`` lists one peer may make us answer per second (an honest one sends ~1)."""
PULL_BURST = 8.0
NOTICE_TTL_S = 120.0
"""A down notice older than this (or dated in the future beyond the clock skew) is ignored. By then
every member has dropped the record it names anyway (``stale_after`` counts from its signature)."""
NOTICES_PER_S = 1.0
"""Down notices accepted per accuser per second, on average ..."""
NOTICE_BURST = 16.0
"""... in bursts of at most this many (an honest accuser reports each failure it sees, once)."""
RECORD_UPDATES_PER_S = 2.0
"""New records accepted per node id per second, on average (an honest node re-signs on a load change at
most every 2 s, on an RTT change at most every :data:`OWN_RESIGN_MIN_S`, and every 30 s anyway) ..."""
RECORD_UPDATE_BURST = 20.0
ADMITTER_UPDATES_PER_S = 4.0
"""... and for all the nodes one member (not the owner) vouched for, together: what a member's own
identities cost is charged to it, so 32 of them re-signing at once cannot flood a node (issue 29) ..."""
ADMITTER_UPDATE_BURST = 40.0
OWN_RESIGN_MIN_S = 1.0
"""Our own record is re-signed for an RTT change at most this often (other peers' limits above)."""
REFUTE_WINDOW_S = 60.0
"""A peer accused and heard alive again within this long refutes the notice."""
REFUTED_TO_BAN = 3
ACCUSER_BAN_S = 300.0
REFUSED_MEMO_S = 60.0
"""A node whose genuine record was refused (its membership) is not asked for for this long."""
ANSWER_WAIT_S = 12.0
"""A peer's answer to our want list or digest carries what we asked for if it comes within this long; later, or
beyond it, an exchange gets the plain cap (``Gossip._items_cap``). Until then no digest makes us ask again for
what we asked for. It is the longest the driver lets one message take to leave a peer (mesh/service.py: 2 s
to queue, 10 s to drain): a starting member of 50 on one 2-core host took 9 s to receive its first answer,
200 KB, and at 5 s it asked again, four times, for the same records."""
REFINE_AT = 16
"""Records per bucket above which differing buckets are answered with their sub-buckets' sums (16 x 8
bytes) rather than a digest of every record in them (about 60 bytes each)."""
FORGED = (BadSignature, WrongSigner, WrongDomain, DecodeError)
"""Verification failures no honest peer forwards (every member checks these the same way)."""


@dataclass(frozen=True, slots=True)
class Send:
    """Send ``message`` to peer ``to`` (over its gossip stream)."""

    to: str
    message: MeshMessage


@dataclass(frozen=True, slots=True)
class Rejected:
    """Something from ``source`` failed verification and was dropped; the driver logs ``error``."""

    source: str
    error: MeshllmError


@dataclass(frozen=True, slots=True)
class AccuserBanned:
    """``node_id``'s down notices were refuted too often: its notices are ignored for a while."""

    node_id: str


@dataclass(frozen=True, slots=True)
class RevocationApplied:
    """A new, verified revocation was applied; ``source`` is the peer it came from (None: made here).

    The driver closes any connection to a revoked node (it may not be in our view yet).
    """

    kind: str
    target: str
    source: str | None


class RevocationLike(Protocol):
    """What the revocation callback returns (``admission.Revocation``)."""

    @property
    def target_kind(self) -> str: ...
    @property
    def target(self) -> str: ...


VerifyRevocation = Callable[[bytes], RevocationLike]
"""Verify a signed revocation record and apply it to admission; raise a MeshllmError if it is bad."""


@dataclass(frozen=True)
class GossipConfig:
    """Timings; defaults aim at a 5 s removal of a killed node and modest traffic."""

    interval: float = 1.0
    """Anti-entropy period, whatever the mesh size (a round costs a summary, not a table)."""
    fanout: int = 2
    """Peers sent a summary each round."""
    push_fanout: int = 2
    """Random connected peers a newly stored record is forwarded to (anti-entropy fills the gaps)."""
    refresh: float = 30.0
    """Re-sign our unchanged record this often (it bounds how long a signed copy is accepted) ..."""
    refresh_rate: float = 2.0
    """... unless the mesh is large: then every N / refresh_rate seconds (see :meth:`refresh_for`)."""
    stale_after: float = 120.0
    """A peer whose record has not been re-signed for this long past its refresh is dropped: the
    backstop for a node no failure detector watches (liveness itself is the detector's)."""
    forget_after: float = 300.0
    """How long down/left tombstones are kept to refuse resurrection by old copies."""
    view_extra: int = 3
    """k in the partial-view size ceil(log2(N)) + k."""
    rotate_every: float = 30.0
    """Swap one random partial-view peer this often."""
    rtt_max_age: float = 30.0

    def refresh_for(self, members: int) -> float:
        """Refresh period in a mesh of ``members``: the refreshes of the whole mesh cost each member
        at most ``refresh_rate`` records a second, so it stretches beyond ``refresh`` past
        ``refresh * refresh_rate`` members (60 by default), up to :data:`REFRESH_MAX_S`."""
        return max(self.refresh, min(REFRESH_MAX_S, members / self.refresh_rate))


def refreshed_only(held: PeerRecord, new: PeerRecord) -> bool:
    """Whether ``new`` says nothing ``held`` did not: only its sequence, signing time and refresh moved,
    and its RTT row stayed within the band its signer re-signs on (:func:`rtt.row_changed`)."""
    if rtt.row_changed(held.rtt, new.rtt):
        return False
    return msgspec.structs.replace(new, seq=held.seq, signed_at=held.signed_at, refresh=held.refresh,
                                   rtt=held.rtt) == held


Output = Send | Rejected | RevocationApplied | AccuserBanned | Overstep | view.ViewEvent


class Gossip:
    """Our record plus everyone's verified records, kept in sync with the mesh."""

    def __init__(
        self,
        key: SigningKey,
        record: PeerRecord,
        verifier: RecordVerifier,
        rng: random.Random,
        now: float,
        config: GossipConfig | None = None,
        verify_revocation: VerifyRevocation | None = None,
    ) -> None:
        """``record.seq`` should start above any earlier run's (e.g. wall-clock milliseconds).

        Without ``verify_revocation``, revocation messages are refused (``Rejected``).
        """
        self.config = config or GossipConfig()
        self._key, self._verifier, self._rng = key, verifier, rng
        self._verify_revocation = verify_revocation
        self.revocations: dict[bytes, None] = {}
        """Verified revocation records, as signed bytes, in the order learned."""
        self.revoked_nodes: set[str] = set()
        record = msgspec.structs.replace(record, signed_at=now)
        self.own, self.own_raw = record, sign_record(key, record)
        self._state = view.empty(record.node_id)
        self._own_pending: Literal["flood", "push"] | None = None
        """Our record was re-signed since we last sent it: ``"flood"`` (it changed: every connected
        peer, at the next tick) or ``"push"`` (a refresh: a few peers; anti-entropy does the rest)."""
        self.connected: set[str] = set()
        self.pinned: set[str] = set()
        self._partial: frozenset[str] = frozenset()
        self._rtt: rtt.RttTable = {}
        self._next_round = self._next_rotate = now
        self._next_expire = now + 1.0
        """When an entry may next expire (a lower bound: sweeping the table is a pass over it)."""
        self._pulls: RateLimit[str] = RateLimit(PULLS_PER_S, PULL_BURST)
        self._notice_rate: RateLimit[str] = RateLimit(NOTICES_PER_S, NOTICE_BURST)
        self._updates: RateLimit[str] = RateLimit(RECORD_UPDATES_PER_S, RECORD_UPDATE_BURST)
        self._vouched_updates: RateLimit[str] = RateLimit(ADMITTER_UPDATES_PER_S, ADMITTER_UPDATE_BURST)
        self._refutations: Strikes[str] = Strikes(REFUTED_TO_BAN, REFUTE_WINDOW_S)
        self._banned: CoolDowns[str] = CoolDowns()
        self._refused: CoolDowns[str] = CoolDowns()
        self._asked: dict[str, tuple[int, float]] = {}
        """peer -> (records we asked it for and it has not sent yet, until when they count): our last ``want``
        list, or, after we answered its summary with a digest, as many as a message may carry (what it gives
        for that digest is all we lack in the buckets that differ). One entry per connected peer at most."""
        self._wanted: dict[str, tuple[str, int, float]] = {}
        """node id -> (the peer we asked for its record, the sequence that peer's digest claimed, until when the
        answer counts): the asks on their way, which a digest from any peer does not repeat."""
        self.answered = False
        """A peer answered a want list or a digest of ours (every record we asked it for is in), or sent a
        digest listing nothing we lack: a joining node's view now holds what that member held."""
        self._accused: dict[str, tuple[str, float]] = {}
        """subject -> (accuser, notice time) of the notice that took it down (refutation tracking)."""
        # A random first phase: nodes started together must not refresh in lockstep.
        self._refresh_from, self._refresh_phase = now, rng.uniform(0.0, 1.0)

    @property
    def node_id(self) -> str:
        return self.own.node_id

    def accuser(self, node: str) -> str | None:
        """Who signed the down notice that took ``node`` down in our view (None: no notice did)."""
        accused = self._accused.get(node)
        return None if accused is None else accused[0]

    @property
    def state(self) -> view.ViewState:
        """The peer table (a value: every change replaces it)."""
        return self._state

    def adopt(self, state: view.ViewState, first_deadline: float) -> None:
        """Start from a table built elsewhere (a simulation that starts converged).

        ``first_deadline`` is when its first entry may expire (``view.deadline``): the caller that
        built the table knows it, and 10,000 simulated nodes need not each pass over 10,000 entries.
        """
        self._state, self._next_expire = state, first_deadline

    # --- queries ---

    def members(self) -> dict[str, PeerRecord]:
        """Live (alive or suspect) peers' records, ourselves excluded."""
        return view.members(self.state)

    def rtt_matrix(self) -> dict[str, dict[str, float]]:
        """Mesh-wide RTT matrix over ourselves and live members."""
        return rtt.rtt_matrix([self.own, *self.members().values()])

    def interval(self) -> float:
        """Round period: the same at any mesh size (a round's cost does not grow with it either)."""
        return self.config.interval

    def refresh_period(self) -> float:
        """How often we re-sign an unchanged record in a mesh of the size we see now."""
        return self.config.refresh_for(self._state.peers.active + 1)

    def watched(self) -> set[str]:
        """The connected peers whose liveness we probe: those we chose (pinned and partial view).

        A connection is probed from the end that wanted it, not from both: a node is still watched by
        every member that drew it (about log2 N + 3 of them, a Poisson number: at 10,000 members the
        chance that nobody watches a given node is about 4e-8, and rotation redraws it every 30 s),
        and the probes cost half. Until we know any member (joining) we watch every connection.
        """
        if not self._state.peers.active:
            return set(self.connected)
        return (self.pinned | self._partial) & self.connected

    def desired_connections(self, now: float) -> set[str]:
        """Peers the driver should hold connections to: pinned peers plus a random partial view.

        Until we know any member (just joined) we keep whatever we are connected to: the bootstrap
        links are our only way into the mesh.
        """
        peers = self._state.peers
        if not peers.active:
            return set(self.connected)

        def live(node: str) -> bool:
            entry = peers.get(node)
            return entry is not None and entry.status in view.ACTIVE

        size = view.view_size(peers.active + 1, self.config.view_extra)
        rotate = now >= self._next_rotate
        if rotate:
            self._next_rotate = now + self.config.rotate_every
        pinned = {p for p in self.pinned if live(p)}
        # Drawn from the table without listing it (10,000 members: a few walks, not a pass).
        if (rotate or not all(live(p) for p in self._partial)
                or len(self._partial) < min(size, peers.active - len(pinned))):
            def draw(k: int, taken: set[str]) -> list[str]:
                return peers.sample(self._rng, k, lambda n, e: e.status in view.ACTIVE
                                    and n not in self.pinned and n not in taken)

            self._partial = view.refresh_partial_view(
                self._partial, lambda p: live(p) and p not in self.pinned, draw, size, self._rng, rotate)
        return pinned | set(self._partial)

    def next_timer(self) -> float:
        """When :meth:`tick` next has work."""
        if self._own_pending:
            return self.own.signed_at
        return min(self._next_round, self._refresh_due(), self._next_expire)

    # --- inputs from the driver ---

    def peer_connected(self, peer: str) -> None:
        """The transport holds an admitted connection to ``peer`` (either direction)."""
        self.connected.add(peer)

    def peer_disconnected(self, peer: str) -> None:
        self.connected.discard(peer)
        self._asked.pop(peer, None)
        self._wanted = {n: w for n, w in self._wanted.items() if w[0] != peer}  # its answers will not come

    def greet(self, peer: str) -> list[Output]:
        """A peer just connected: trade digests with it now rather than at the next round.

        While we know no member (we are joining), we send a coarse summary (16 sums): it differs
        from the peer's in every bucket it fills, so the peer answers with its digest (or, past 16
        records, with finer sums, which our digest answers, and it gives what we lack), and we learn
        the whole mesh in one exchange. A member sends none: connections come and go (rotations,
        indirect probes) and the next round's summary repairs any difference anyway. The
        revocations we know go to every new peer, so a late joiner learns them too.
        """
        out: list[Output] = [] if self._state.peers.active else [Send(peer, self._summary())]
        known = list(self.revocations)
        for i in range(0, len(known), REVOCATIONS_PER_MESSAGE):
            out.append(Send(peer, Revocations(known[i:i + REVOCATIONS_PER_MESSAGE])))
        return out

    def observe_rtt(self, peer: str, rtt_ms: float, path: PathKind, now: float) -> None:
        """A transport RTT measurement; published with the next refresh or significant change."""
        self._rtt = rtt.observe_rtt(self._rtt, peer, rtt_ms, path, now)

    def update_own(self, now: float, **changes: Any) -> None:
        """Change fields of our record (load, models, ...); bumps the sequence and re-signs."""
        self._resign(now, **changes)

    def tick(self, now: float, stretch: int = 1) -> list[Output]:
        """Refresh, housekeeping and, when due, one anti-entropy round.

        ``stretch`` (1 + the failure detector's local-health score) spaces the next round that many
        periods away: a node whose loop runs late repairs less often, and only the repair waits
        (changes are pushed and floods sent as before). On a saturated host of 50 members that cut
        summaries and digests about fourfold (docs/benchmarks.md).
        """
        out: list[Output] = []
        row = rtt.current_row(self._rtt, now, self.config.rtt_max_age)
        if rtt.row_changed(self.own.rtt, row) and now - self.own.signed_at >= OWN_RESIGN_MIN_S:
            self._resign(now, rtt=row)
        elif now >= self._refresh_due():
            self._resign(now, refresh_only=not rtt.row_changed(self.own.rtt, row), rtt=row)
        if self._own_pending == "push":
            self._own_pending = None
            out += self._push(Exchange([self.own_raw]), exclude=None)
        elif self._own_pending:
            out += self._flood_own()
        if now >= self._next_expire:
            soonest = self._soonest_deadline()
            if now > soonest:
                cfg = self.config
                before = self._state
                out += self._apply(view.Expire(now, cfg.stale_after, cfg.forget_after), None)
                for gone in set(before.peers) - set(self._state.peers):
                    self._verifier.forget(gone)
                self._accused = {n: a for n, a in self._accused.items()
                                 if (e := self._state.peers.get(n)) is not None and e.status == "down"}
                soonest = self._soonest_deadline()
            self._next_expire = max(now + 1.0, soonest)
        if now >= self._next_round:
            self._next_round = now + self.interval() * stretch
            reachable = sorted(self.connected)
            summary = self._summary()
            for peer in self._rng.sample(reachable, min(self.config.fanout, len(reachable))):
                out.append(Send(peer, summary))
        return out

    def receive(self, source: str, message: MeshMessage, now: float) -> list[Output]:
        """Handle one gossip message from connected peer ``source``."""
        if isinstance(message, Summary):
            if not self._pulls.allow(source, now):
                return [Overstep(source, "summaries faster than gossip answers them")]
            return self._on_summary(source, message, now)
        if isinstance(message, Digest):
            if not self._pulls.allow(source, now):
                return [Overstep(source, "digests faster than gossip answers them")]
            return self._on_digest(source, message, now)
        if isinstance(message, Exchange):
            out: list[Output] = []
            asked = self._credit(source, now)
            _, until = self._asked.pop(source, (0, now))
            records = message.records[: self._items_cap(asked)]
            if asked > len(records):  # a push that came first spends the credit only by what it carried
                self._asked[source] = asked - len(records), until
            for raw in records:
                result = self._ingest(raw, source, now)
                if result and isinstance(result[0], Rejected):
                    return out + result[:1] + self._forged(result[0])  # drop the rest unread
                if result and isinstance(result[0], Overstep) and any(isinstance(o, Overstep) for o in out):
                    continue  # one strike a message for records over the rate
                out += result
            if asked and not self.answered:
                self.answered = not self._awaited_from(source)
            if message.want and not self._pulls.allow(source, now):
                return [*out, Overstep(source, "want lists faster than gossip answers them")]
            # Only ids we hold (or ours), each once: a want list can cost us no more than one copy
            # of our table, however long the sender made it.
            want = [n for n in dict.fromkeys(message.want) if n == self.node_id or n in self.state.peers]
            if want:
                out += [Send(source, m) for m in self._exchanges(want[: len(self.state.peers) + 1], [])]
            return out
        if isinstance(message, Notices):
            out = []
            for raw in message.notices[: self._items_cap()]:
                result = self._on_notice(raw, source, now)
                if result and isinstance(result[0], Rejected):
                    return out + result[:1] + self._forged(result[0])
                out += result
            return out
        if isinstance(message, Revocations):
            out = []
            for raw in message.records[:REVOCATIONS_PER_MESSAGE]:
                try:
                    out += self._revocation(raw, source, now)
                except MeshllmError as exc:
                    return [*out, Rejected(source, exc)]  # a forged one: drop the rest unread
            return out
        return []

    def on_detector(self, events: Iterable[Suspected | Recovered | Failed], now: float) -> list[Output]:
        """Apply the failure detector's verdicts: suspect, alive again, or down (signed and flooded)."""
        out: list[Output] = []
        for ev in events:
            if isinstance(ev, Suspected):
                out += self._apply(view.MarkSuspect(ev.node_id, now), ev.node_id)
            elif isinstance(ev, Recovered):
                out += self._apply(view.MarkAlive(ev.node_id, now), ev.node_id)
            else:
                out += self.declare_down(ev.node_id, now)
        return out

    def declare_down(self, node_id: str, now: float) -> list[Output]:
        """Sign a down notice for a live member, apply it, and flood it."""
        entry = self.state.peers.get(node_id)
        if entry is None or entry.status not in view.ACTIVE:
            return []
        raw = sign_notice(self._key, DownNotice(node_id, entry.record.seq, self.node_id, now))
        out = self._apply(view.MarkDown(node_id, entry.record.seq, raw, now), node_id)
        self._accused[node_id] = (self.node_id, now)
        return out + self._flood(Notices([raw]), exclude=None)

    def add_revocation(self, raw: bytes, now: float) -> list[Output]:
        """A revocation signed here (by the mesh-key holder): verify, apply and flood it.

        Raises the verification error if it is bad; a record we already hold changes nothing.
        """
        return self._revocation(raw, None, now)

    def leave(self, now: float) -> list[Output]:
        """Graceful leave: a signed ``leaving`` record, pushed to every connected peer at once."""
        self._resign(now, state="leaving")
        return self._flood_own()

    # --- internals ---

    def _revocation(self, raw: bytes, source: str | None, now: float) -> list[Output]:
        if raw in self.revocations:
            return []  # already applied and flooded: each revocation travels each link once
        if self._verify_revocation is None:
            raise VerificationError("this node does not accept revocations")
        if len(raw) > REVOCATION_MAX:
            raise DecodeError(f"revocation of {len(raw)} bytes exceeds {REVOCATION_MAX}")
        rev = self._verify_revocation(raw)
        self.revocations[raw] = None
        out: list[Output] = [RevocationApplied(rev.target_kind, rev.target, source)]
        if rev.target_kind == "node":
            self.revoked_nodes.add(rev.target)
            if rev.target != self.node_id:
                out += self._apply(view.MarkRevoked(rev.target, now), rev.target)
        # Every peer whose credential no longer holds is out too: members of a revoked invite, and
        # nodes admitted (directly or down the chain) by a revoked node. The membership check says so.
        for node, entry in list(self.state.peers.items()):
            if entry.status == "revoked":
                continue
            try:
                self._verifier.check_member(node, entry.record.membership_proof, now)
            except Revoked:
                out += self._apply(view.MarkRevoked(node, now), node)
            except MeshllmError:
                pass  # not this revocation's business
        return out + self._flood(Revocations([raw]), exclude=source)

    def _credit(self, source: str, now: float) -> int:
        """The records ``source`` may still send us because we asked (0 once ``ANSWER_WAIT_S`` has passed)."""
        asked, until = self._asked.get(source, (0, now))
        return asked if now <= until else 0

    def _awaited_from(self, peer: str) -> bool:
        """Whether we still lack a record we asked ``peer`` for: its answer is not all in yet. A push it
        sent before the answer (one record) made a restarted member of 50 call itself ready on a view of
        one (docs/benchmarks.md)."""
        return any(asked_of == peer and self._held_or_none(node) < seq
                   for node, (asked_of, seq, _) in self._wanted.items())

    def _items_cap(self, asked: int = 0) -> int:
        """Records or notices to verify from one message: what a full sync could need, bounded.

        ``asked``: how many records our last ``want`` list asked the sender for. Without it a node that
        just joined (holding nothing) took 16 of a mesh of 50 from its first exchange, 32 more from the
        next round's and the rest from a third: on a loaded host, 10 s before a restarted member saw the
        mesh (docs/benchmarks.md).
        """
        return min(len(self.state.peers) + ITEMS_SLACK + asked, ITEMS_MAX)

    def _resign(self, now: float, above: int = 0, refresh_only: bool = False, **changes: Any) -> None:
        """Bump our sequence past ``above`` (a *verified* copy of us to outrank) and re-sign.

        ``refresh_only``: nothing but the signing time changes, so it is pushed to a few peers, not
        flooded (unless a change is still waiting to go out). The new record is built and signed
        before anything is assigned, so a signing failure leaves our state exactly as it was.
        """
        # The record promises its next refresh within ``refresh``: members stretch its age and
        # silence limits by as much, so it never promises less than the period we will keep.
        refresh = max(REFRESH_S, self.refresh_period())
        record = msgspec.structs.replace(self.own, seq=max(self.own.seq, above) + 1, signed_at=now,
                                         refresh=refresh, **changes)
        raw = sign_record(self._key, record)
        self.own, self.own_raw = record, raw
        self._refresh_from, self._refresh_phase = now, 1.0
        self._own_pending = "push" if refresh_only and self._own_pending != "flood" else "flood"

    def _refresh_due(self) -> float:
        """When we next re-sign: one period after the last, never later than our record promised."""
        period = min(self.refresh_period(), max(self.config.refresh, self.own.refresh))
        return self._refresh_from + self._refresh_phase * period

    def _flood_own(self) -> list[Output]:
        """Our current record to every connected peer (each change once)."""
        self._own_pending = None
        return self._flood(Exchange([self.own_raw]), exclude=None)

    def _deadline(self, entry: view.PeerEntry) -> float:
        return view.deadline(entry, self.config.stale_after, self.config.forget_after)

    def _soonest_deadline(self) -> float:
        """When the first entry expires (a pass over the table: run only when a bound is due)."""
        return min(map(self._deadline, self._state.peers.values()), default=math.inf)

    def _sums(self, level: int, buckets: list[int] | None = None) -> list[int]:
        """Our table's sums of ``buckets`` of ``level`` (default: all of them), our own record included."""
        peers = self._state.peers
        sums = peers.sums(level) if buckets is None else [peers.bucket_sum(level, b) for b in buckets]
        mine = view.bucket_of(self.node_id, level)
        for i, bucket in enumerate(range(len(sums)) if buckets is None else buckets):
            if bucket == mine:
                sums[i] ^= view.entry_hash(self.node_id, self.own.seq, True)
        return sums

    def _summary(self, level: int = 1, buckets: list[int] | None = None) -> Summary:
        """Our sums of ``buckets`` of ``level`` (default: the 16 of level 1, each round's opener).

        A round opens with 16 sums (128 bytes) at any mesh size: a converged pair stops there, and
        a pair that differs refines only the differing buckets (16 sub-sums each) down to a digest.
        Opening with 256 sums cost a converged 1,000-node mesh ten times as much for no faster
        convergence (docs/benchmarks.md).
        """
        sums = self._sums(level, buckets)
        return Summary(level, struct.pack(f"<{len(sums)}Q", *sums), buckets or [])

    def _on_summary(self, source: str, message: Summary, now: float) -> list[Output]:
        """Answer a summary: where sums differ, finer sums while buckets are big, then a digest."""
        level, buckets = message.level, list(dict.fromkeys(message.buckets)) or None
        count = 16**level if buckets is None else len(buckets)
        if len(message.sums) != 8 * count or len(message.buckets) != len(buckets or []) \
                or any(b >= 16**level for b in buckets or []):
            return [Rejected(source, DecodeError(f"a level-{level} summary needs one sum per bucket it names"))]
        theirs = struct.unpack(f"<{count}Q", message.sums)
        named = range(count) if buckets is None else buckets
        differ = [b for b, ours, their in zip(named, self._sums(level, buckets), theirs, strict=True) if ours != their]
        if not differ:
            return []
        if level < view.LEVELS and len(self._state.peers) > REFINE_AT * 16**level:
            # Buckets this full would cost a long digest each: trade their sixteen sub-buckets first.
            return [Send(source, self._summary(level + 1, [b * 16 + i for b in differ for i in range(16)]))]
        seqs = {node: entry.record.seq for node, entry in self._state.peers.in_buckets(level, differ)}
        if view.bucket_of(self.node_id, level) in differ:
            seqs[self.node_id] = self.own.seq
        # Its answer gives all we lack there. With the plain cap (what we hold plus 16), a joining node
        # holding nothing took 16 records from the exchange meant to teach it the mesh: a peer holding
        # over 256 records answers a joiner's greeting with finer sums, so the greeting ends here.
        self._asked[source] = max(self._credit(source, now), ITEMS_MAX), now + ANSWER_WAIT_S
        return [Send(source, Digest(seqs, level, differ))]

    def _on_digest(self, source: str, message: Digest, now: float) -> list[Output]:
        theirs = message.seqs
        # A digest may cover only some buckets (the answer to our summary): we give only from those.
        if message.level:
            scope: Iterable[tuple[str, view.PeerEntry]] = self._state.peers.in_buckets(
                message.level, sorted(set(message.buckets)))
            mine = view.bucket_of(self.node_id, message.level) in message.buckets
        else:
            scope, mine = self._state.peers.items(), True
        # A digest's sequences are unsigned claims: never re-sign on one. If the peer claims a copy
        # of us newer than ours, ask for it; _ingest verifies our signature and outranks it then.
        their_own = theirs.get(self.node_id, -1)
        give = [self.node_id] if mine and their_own < self.own.seq else []
        want_own = [self.node_id] if their_own > self.own.seq else []
        notices: list[bytes] = []
        for node, entry in scope:
            seq = theirs.get(node)
            if entry.notice is not None and entry.status == "down":
                accused = self._accused.get(node)
                fresh = accused is not None and now - accused[1] <= NOTICE_TTL_S
                if seq is not None and seq == entry.record.seq and fresh:
                    notices.append(entry.notice)
            elif seq is None or seq < entry.record.seq:
                give.append(node)
        self._wanted = {n: w for n, w in self._wanted.items() if w[2] > now}
        lacking = [n for n, s in theirs.items()
                   if n != self.node_id and n not in self.revoked_nodes and s > self._held_or_none(n)
                   and not self._refused.remaining(n, now)]
        on_the_way = {n for n in lacking if (w := self._wanted.get(n)) is not None and w[1] >= theirs[n]}
        want = want_own + [n for n in lacking if n not in on_the_way][:WANT_MAX]
        if want:
            # (an earlier ask of it may still be answering)
            self._asked[source] = self._credit(source, now) + len(want), now + ANSWER_WAIT_S
            for node in want[len(want_own):]:
                self._wanted[node] = source, theirs[node], now + ANSWER_WAIT_S
        elif not on_the_way:
            self.answered = True  # we hold all it listed
        out: list[Output] = [Send(source, m) for m in self._exchanges(give, want)]
        if notices:
            out.append(Send(source, Notices(notices)))
        return out

    def _exchanges(self, nodes: list[str], want: list[str]) -> list[Exchange]:
        """Records of ``nodes`` we can give (never a down peer's), chunked under the frame cap."""
        chunks: list[Exchange] = []
        batch: list[bytes] = []
        size = 0
        for node in nodes:
            entry = self.state.peers.get(node)
            if node == self.node_id:
                raw = self.own_raw
            elif entry is not None and entry.status not in ("down", "revoked"):
                raw = entry.raw
            else:
                continue
            if batch and size + len(raw) > EXCHANGE_BUDGET:
                chunks.append(Exchange(batch))
                batch, size = [], 0
            batch.append(raw)
            size += len(raw)
        if batch or want:
            chunks.append(Exchange(batch, want))
        return chunks

    def _ingest(self, raw: bytes, source: str, now: float) -> list[Output]:
        state = self.state
        try:
            record = self._verifier.verify(raw, now, lambda n: self._held(state, n))
        except MeshllmError as exc:
            if isinstance(exc, StaleRecord):
                return []  # routine in gossip: several peers hand us the same version
            if isinstance(exc, Revoked) and self.revocations:
                return []  # refused; routine while a revocation spreads (peers still hold its records)
            if not isinstance(exc, FORGED):
                node = self._record_id(raw)
                if node is not None:
                    if self._refused.remaining(node, now):
                        return []  # refused already: said once, not again every round
                    self._refused.add(node, now, REFUSED_MEMO_S)
            return [Rejected(source, exc)]
        if record.node_id == self.node_id:
            if record.seq >= self.own.seq:
                self._resign(now, above=record.seq)
            return []
        if record.signed_at < self._tombstone_time(record.node_id) - CLOCK_SKEW_S:
            return []  # signed before the node died or left: a replayed copy, not the node coming back
        if (over := self._over_rate(record, now)) is not None:
            # not stored, so not passed on: only its signer, or the member that vouched for it, sent it here
            return [Overstep(source, over)] if source in (record.node_id, vouching_member(record.membership_proof)) \
                else []
        accused = self._accused.pop(record.node_id, None)
        recent = accused is not None and now - accused[1] <= REFUTE_WINDOW_S
        events = self._refute(accused[0], now) if accused is not None and recent else []
        prior = state.peers.get(record.node_id)
        events += self._apply(view.RecordStored(record, raw, now), record.node_id)
        if any(isinstance(e, view.PeerAdded | view.PeerRemoved) for e in events):
            events += self._flood(Exchange([raw]), exclude=source)
        elif any(isinstance(e, view.RecordUpdated) for e in events) and not (
                prior is not None and refreshed_only(prior.record, record)):
            events += self._push(Exchange([raw]), exclude=source)
        return events

    def _tombstone_time(self, node: str) -> float:
        """When ``node`` was last known to stop (-inf: it is not a tombstone here).

        Its down notice's time, or the signing time of its leaving (or last) record. A record signed
        earlier cannot bring it back, whatever its sequence: the node itself, alive again, signs a
        new one (a refutation is signed after the notice it answers). With no heartbeats, records
        of a large mesh are accepted for a long time (``refresh``), so age alone would not stop a
        copy signed minutes before a death from undoing the death.
        """
        entry = self._state.peers.get(node)
        if entry is None or entry.status not in ("down", "left"):
            return -math.inf
        accused = self._accused.get(node)
        return accused[1] if accused is not None else entry.record.signed_at

    def _over_rate(self, record: PeerRecord, now: float) -> str | None:
        """Why a new, verified record is one update too many (None: within the limits, now counted)."""
        if not self._updates.allow(record.node_id, now):
            return f"records of {record.node_id[:8]} re-signed faster than {RECORD_UPDATES_PER_S:g} a second"
        voucher = vouching_member(record.membership_proof)
        if voucher is not None and not self._vouched_updates.allow(voucher, now):
            return (f"records of the nodes {voucher[:8]} vouched for re-signed faster than "
                    f"{ADMITTER_UPDATES_PER_S:g} a second together")
        return None

    def _held_or_none(self, node: str) -> int:
        held = view.held_seq(self.state, node)
        return -1 if held is None else held

    def _held(self, state: view.ViewState, node: str) -> int | None:
        return self.own.seq if node == self.node_id else view.held_seq(state, node)

    def _on_notice(self, raw: bytes, source: str, now: float) -> list[Output]:
        try:
            verified = verify_notice(raw, self._verifier.cache)
        except MeshllmError as exc:
            return [Rejected(source, exc)]
        notice, reporter = verified.notice, verified.notice.reporter
        rep = self.state.peers.get(reporter)
        if reporter != self.node_id and (rep is None or rep.status not in view.ACTIVE):
            # counts for nothing, and says nothing against the peer that passed it on: routine while
            # membership spreads (an accuser we hold down, or have not heard of yet), so the notices
            # behind it in the message are still read and nothing is logged (in a storm of false
            # downs, hundreds of lines a minute, each dropping the rest of its message)
            return []
        if not now - NOTICE_TTL_S <= notice.ts <= now + CLOCK_SKEW_S:
            return []  # expired (a replay or a late resend): it proves nothing about now
        if reporter == self.node_id or self._banned.remaining(reporter, now):
            return []
        held = self.state.peers.get(notice.subject)
        if held is not None and held.status == "down" and held.record.seq == notice.subject_seq:
            # What we already hold, sent again (anti-entropy resends notices to peers whose digest still
            # lists the node): it changes nothing and costs the accuser nothing, or every honest
            # accuser of a dead node would soon be cut off for resending its one notice.
            return []
        if not self._notice_rate.allow(reporter, now):
            return [Overstep(source, "down notices faster than any honest accuser signs them")] \
                if source == reporter else []
        if notice.subject == self.node_id:
            if notice.subject_seq > self.own.seq:
                # We never signed that sequence: a garbage claim (or a copy of us from an earlier
                # run, which anti-entropy fetches and _ingest outranks). Never re-sign on it.
                return self._refute(reporter, now)
            if notice.subject_seq == self.own.seq:  # refute: our new record outranks the notice
                self._resign(now)
            return self._refute(reporter, now) + self._flood_own()
        subject = self.state.peers.get(notice.subject)
        if subject is not None and subject.status == "alive" and notice.subject in self.watched():
            return self._refute(reporter, now)  # our own probes hear it: the notice is wrong
        events = self._apply(view.MarkDown(notice.subject, notice.subject_seq, raw, now), notice.subject)
        if events:
            self._accused[notice.subject] = (reporter, notice.ts)
            events += self._flood(Notices([raw]), exclude=source)
        return events

    def _refute(self, accuser: str, now: float) -> list[Output]:
        """``accuser``'s notice was wrong; too many wrong ones and its notices are ignored a while."""
        if accuser == self.node_id or not self._refutations.add(accuser, now):
            return []
        self._banned.add(accuser, now, ACCUSER_BAN_S)
        return [AccuserBanned(accuser)]

    def _forged(self, rejected: Rejected) -> list[Output]:
        """A cryptographically bad item is something no honest peer forwards: count it."""
        if isinstance(rejected.error, FORGED):
            return [Overstep(rejected.source, f"forwarded a forged item ({type(rejected.error).__name__})")]
        return []

    @staticmethod
    def _record_id(raw: bytes) -> str | None:
        try:
            return decode_record(raw)[1].node_id
        except MeshllmError:
            return None

    def _apply(self, update: view.Update, node: str | None) -> list[Output]:
        old, self._state = self._state, view.apply(self._state, update)
        if node is not None and (entry := self._state.peers.get(node)) is not None:
            self._next_expire = min(self._next_expire, self._deadline(entry))
        return list(view.diff(old, self._state, None if node is None else [node]))

    def _flood(self, message: MeshMessage, exclude: str | None) -> list[Output]:
        return [Send(p, message) for p in sorted(self.connected) if p != exclude]

    def _push(self, message: MeshMessage, exclude: str | None) -> list[Output]:
        """``message`` to a few random connected peers: they push it on, anti-entropy fills gaps."""
        peers = sorted(p for p in self.connected if p != exclude)
        return [Send(p, message) for p in self._rng.sample(peers, min(self.config.push_fanout, len(peers)))]
