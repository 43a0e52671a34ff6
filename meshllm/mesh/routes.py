"""Route tables for passive clients: a sans-IO protocol (the driver is :mod:`meshllm.mesh.passive`).

A passive client (``serve --client`` joining a mesh) takes no part in gossip: it holds one
connection to a member (its *anchor*) and asks it, on an interval and on demand, for a
**route table**: every live member (serving nodes first) with its addresses, the models it takes
requests for, its load, and the anchor's RTT to it. That is all routing, failover and replay need,
so the client routes exactly as a member does; but no member holds anything about it beyond its
connection (it is in nobody's view, gossip never carries it, and nobody probes it), so hundreds of
clients cost the mesh a stream per pull, not a gossip member each.

The table is built from the anchor's own gossip view and **signed by the anchor** (domain
``route-table``): the client checks the signer is the member it asked, the mesh, the issue time
(fresh, and not older than the table it holds: no replays) and the bounds (entries, bytes, fields
per entry) before it changes anything, and refuses a bad table with a reason. A lying anchor can
at worst hide nodes or misstate loads: every node the client then dials still proves its identity
and membership at admission.

Pulls are cheap when nothing changed: the client names the version (a digest of the entries) it
holds and the anchor answers :class:`RoutesSame`. Loads and RTTs are quantised before they enter
the digest, so jitter does not count as a change.
"""

from __future__ import annotations

import hashlib
import math
import random
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Annotated, Literal

import msgspec
from nacl.signing import SigningKey

from meshllm.errors import MeshllmError, VerificationError, WrongMesh, WrongSigner
from meshllm.identity.ids import node_id as node_id_of
from meshllm.identity.ids import node_public_key
from meshllm.identity.signing import CLOCK_SKEW_S, decode_signed, encode_signed, sign, verify
from meshllm.mesh import rtt, view
from meshllm.mesh.records import (
    MAX_DEMAND,
    Addresses,
    Load,
    ModelName,
    Models,
    PeerRecord,
    Role,
    RttEntry,
    RttMs,
    ServedModel,
    takes_requests,
)

ROUTES_STREAM = "routes"
"""Stream kind of a pull: one :class:`RoutesAsk` up, one :data:`RoutesReply` down."""
ROUTES_DOMAIN = "route-table"
TABLE_MAX_ENTRIES = 256
"""Members one table lists (serving nodes first): bounds what an anchor can make a client hold."""
TABLE_MAX_BYTES = 512 * 1024
"""Cap on a signed table's wire size (and on the reply frame that carries it)."""
ADDRS_MAX = 8
MODELS_MAX = 32
TABLE_MAX_AGE_S = 120.0
"""A table signed longer ago than this is refused (a replay); anchors re-sign an unchanged one at half of it."""
PULL_INTERVAL_S = 60.0
"""How often a client asks its anchor, by default (and at once on demand: a failed node, an unknown model, a
lost anchor). Each pull costs the anchor a few QUIC packets, and a member's idle CPU is little more than
its gossip: a pull a minute from 50 clients is a few per cent of it (docs/benchmarks.md, "Passive clients")."""
PULL_INTERVAL_MAX_S = 100.0
"""Pulls are the only traffic on an anchor connection (it carries no probes): they must come before the
connection's idle timeout (:data:`~meshllm.net.quic.ACCEPT_IDLE_TIMEOUT`, 120 s) closes it."""
FOLLOW_S = 2.0
"""After a table that added or removed members (and after the first), the next pull comes this soon, then
each one twice as late up to the interval: a mesh in flux (nodes joining) is followed within seconds, a
settled one costs a pull a minute."""
BUSY_INTERVAL_S = 5.0
"""While a client routes requests, it pulls at least this often: loads move and standby nodes start serving
under its own load. A client in use costs the mesh its requests, next to which a pull is nothing; the
hundreds that sit idle pull once a minute."""
ON_DEMAND_MIN_S = 0.5
"""Pulls on demand are at most this frequent: a burst of failures asks once."""
HINT_DELAY_S = 0.2
"""A member tells its passive clients that the mesh changed this long after the change, so a burst (a
node that joins and learns a dozen members) is one hint."""
HINT_GAP_S = 1.0
"""... and at most once in this long: under churn a member's clients pull at most once a second on hints."""
ANCHORS = 1
"""Members a client holds a connection to and pulls from. One: a second would need keepalives of its own,
a few packets of each member's time per client, and a lost anchor is replaced by dialing another member
the table lists (a pull that fails within its deadline, or a closed connection, asks for one at once)."""
STALE_AFTER_S = 30.0
"""Members a table no longer lists stay as ``down`` tombstones this long (routers answer 503, not 404)."""


Name = Annotated[str, msgspec.Meta(max_length=200)]
Addr = Annotated[str, msgspec.Meta(max_length=300)]
Status = Literal["alive", "suspect"]


class RouteModel(msgspec.Struct, frozen=True, array_like=True):
    """A model a node takes requests for (whole, or as a split's coordinator)."""

    name: Name
    context: Annotated[int, msgspec.Meta(ge=0, lt=2**31)]
    engine: Annotated[str, msgspec.Meta(max_length=32)]
    id: Annotated[str, msgspec.Meta(max_length=64)] = ""
    tools: bool = False


class RouteEntry(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """One member as a client needs it: where it is, what it serves, how busy and how far it is."""

    node_id: Annotated[str, msgspec.Meta(max_length=64)]
    name: Name = ""
    role: Role = "host"
    status: Status = "alive"
    listen: Annotated[list[Addr], msgspec.Meta(max_length=ADDRS_MAX)] = []
    observed: Annotated[list[Addr], msgspec.Meta(max_length=ADDRS_MAX)] = []
    relay: Annotated[list[Addr], msgspec.Meta(max_length=ADDRS_MAX)] = []
    models: Annotated[list[RouteModel], msgspec.Meta(max_length=MODELS_MAX)] = []
    load: Load = Load()
    rtt_ms: RttMs | None = None
    """The issuing anchor's round trip to the node, quantised (None: it has not measured one)."""
    standby: Annotated[list[ModelName], msgspec.Meta(max_length=MAX_DEMAND)] = []
    """Models the node would start serving on demand (shown in the client's status, as a member shows them)."""


class RouteTable(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """An anchor's signed view of the mesh for passive clients."""

    mesh_id: Annotated[str, msgspec.Meta(max_length=64)]
    issuer: Annotated[str, msgspec.Meta(max_length=64)]
    issued: Annotated[float, msgspec.Meta(ge=0.0, le=1e11)]
    version: Annotated[str, msgspec.Meta(max_length=64)]
    entries: Annotated[list[RouteEntry], msgspec.Meta(max_length=TABLE_MAX_ENTRIES)]


class RoutesAsk(msgspec.Struct, tag="routes-ask", frozen=True):
    """Client -> anchor: the version held ("" for none)."""

    held: Annotated[str, msgspec.Meta(max_length=64)] = ""


class RoutesSame(msgspec.Struct, tag="routes-same", frozen=True):
    """Anchor -> client: the version held is current."""

    version: Annotated[str, msgspec.Meta(max_length=64)]


class RoutesTable(msgspec.Struct, tag="routes-table", frozen=True):
    """Anchor -> client: a new table (a :class:`~meshllm.identity.signing.Signed` :class:`RouteTable`)."""

    table: bytes


RoutesReply = RoutesSame | RoutesTable


class RoutesChanged(msgspec.Struct, tag="routes-changed", frozen=True):
    """Anchor -> client, one datagram: a member joined or left, or changed the models it serves. The client
    pulls at once unless it already holds ``version`` (a lost hint costs only the wait for the next pull)."""

    version: Annotated[str, msgspec.Meta(max_length=64)]


HINT_MAX_BYTES = 128
"""A hint datagram is about 90 bytes: anything longer is not one."""


class BadRouteTable(VerificationError):
    """A route table was refused: stale, from the future, replayed, oversized or malformed."""


# --- the anchor's side ---------------------------------------------------------------------------


def quantise_rtt(ms: float, held: float | None = None) -> float:
    """RTT in steps of about 20 %, at least ``rtt.RTT_FLOOR_MS``; ``held`` (the value published before)
    stays while ``ms`` is within its band (``rtt.within_band``), so jitter does not change a table's version."""
    if held is not None and rtt.within_band(ms, held):
        return held
    ms = max(ms, rtt.RTT_FLOOR_MS)
    return round(rtt.RTT_FLOOR_MS * 1.2 ** round(math.log(ms / rtt.RTT_FLOOR_MS, 1.2)), 3)


def _quantise_load(load: Load) -> Load:
    return msgspec.structs.replace(load, tok_s=float(round(load.tok_s)))


def entry_of(record: PeerRecord, status: Status, rtt_ms: float | None, held_rtt: float | None = None) -> RouteEntry:
    """A member's route entry from its verified record (fields cut to the table's bounds)."""
    models = [RouteModel(m.name[:200], m.context, m.engine[:32], m.id[:64], m.tools)
              for m in record.models.served if takes_requests(m)][:MODELS_MAX]
    addrs = record.addresses
    return RouteEntry(
        node_id=record.node_id, name=record.name[:200], role=record.role, status=status,
        listen=[a for a in addrs.listen if len(a) <= 300][:ADDRS_MAX],
        observed=[a for a in addrs.observed if len(a) <= 300][:ADDRS_MAX],
        relay=[a for a in addrs.relay if len(a) <= 300][:ADDRS_MAX],
        models=models, load=_quantise_load(record.load), standby=list(record.standby),
        rtt_ms=None if rtt_ms is None else quantise_rtt(rtt_ms, held_rtt),
    )


def build_entries(own: PeerRecord, peers: Mapping[str, view.PeerEntry],
                  held_rtt: Mapping[str, float] | None = None) -> list[RouteEntry]:
    """The anchor itself and every live member (each a possible anchor), serving nodes first, then
    hosts and workers, then member clients, each group by id; bounded. ``held_rtt``: the RTTs the
    previous table published (kept while the measured ones stay near them)."""
    held_rtt = held_rtt or {}
    entries = [entry_of(own, "alive", None)]
    for node_id, held in peers.items():
        if held.status not in view.ACTIVE:
            continue
        measured = own.rtt.get(node_id)
        status: Status = "alive" if held.status == "alive" else "suspect"
        kept = held_rtt.get(node_id)
        ms = measured.rtt_ms if measured is not None else kept  # not connected now: the last value stands
        entries.append(entry_of(held.record, status, ms, kept))
    entries.sort(key=lambda e: (not e.models, e.role == "client", e.node_id))
    return entries[:TABLE_MAX_ENTRIES]


def version_of(entries: list[RouteEntry]) -> str:
    """The digest clients name to ask whether anything changed."""
    return hashlib.sha256(msgspec.msgpack.encode(entries)).hexdigest()[:32]


class RouteTableServer:
    """The anchor's side: answers pulls from a cached signed table, re-signed only when it changes.

    Holds nothing per client: an ask is answered from the view as it is now and forgotten.
    """

    def __init__(self, key: SigningKey, mesh_id: str) -> None:
        self._key, self._mesh_id = key, mesh_id
        self._node_id = node_id_of(bytes(key.verify_key))
        self._inputs: tuple[object, object] | None = None
        self._version = ""
        self._signed = b""
        self._issued = 0.0
        self._rtt: dict[str, float] = {}
        """RTTs the current table publishes, per member (not per client)."""

    def version(self, own: PeerRecord, peers: Mapping[str, view.PeerEntry], now: float) -> str:
        """The version a pull would get now (what a hint names)."""
        self._refresh(own, peers, now)
        return self._version

    def answer(self, ask: RoutesAsk, own: PeerRecord, peers: Mapping[str, view.PeerEntry], now: float) -> RoutesReply:
        """The reply to one pull: ``RoutesSame`` if the client holds the current version, else the table."""
        self._refresh(own, peers, now)
        if ask.held and ask.held == self._version:
            return RoutesSame(self._version)
        return RoutesTable(self._signed)

    def _refresh(self, own: PeerRecord, peers: Mapping[str, view.PeerEntry], now: float) -> None:
        """Rebuild when the view changed (gossip replaces it on every change); re-sign when the
        version changed or the signed table is half way to :data:`TABLE_MAX_AGE_S`."""
        inputs = (own, peers)
        if self._inputs is None or self._inputs[0] is not own or self._inputs[1] is not peers:
            entries = build_entries(own, peers, self._rtt)
            self._rtt = {e.node_id: e.rtt_ms for e in entries if e.rtt_ms is not None}
            version = version_of(entries)
            self._inputs = inputs
            if version != self._version or now - self._issued > TABLE_MAX_AGE_S / 2:
                self._sign(entries, version, now)
        elif now - self._issued > TABLE_MAX_AGE_S / 2:
            self._sign(build_entries(own, peers, self._rtt), self._version, now)

    def _sign(self, entries: list[RouteEntry], version: str, now: float) -> None:
        while True:
            table = RouteTable(mesh_id=self._mesh_id, issuer=self._node_id, issued=now, version=version,
                               entries=entries)
            signed = encode_signed(sign(self._key, ROUTES_DOMAIN, table))
            if len(signed) <= TABLE_MAX_BYTES or len(entries) <= 1:
                break
            entries = entries[: len(entries) * 3 // 4]  # huge addresses or names: list fewer members
            version = version_of(entries)
        self._signed, self._version, self._issued = signed, version, now


def routing_key(own: PeerRecord, peers: Mapping[str, view.PeerEntry]) -> int:
    """What a hint is about: who the members are and which models each takes requests for. Loads and RTTs
    are left out: they move with every request, and a client in use pulls every few seconds anyway
    (:data:`BUSY_INTERVAL_S`)."""
    return hash(frozenset(
        (node_id, frozenset(m.name for m in record.models.served if takes_requests(m)))
        for node_id, record in [(own.node_id, own), *((n, e.record) for n, e in peers.items()
                                                       if e.status in view.ACTIVE)]))


@dataclass
class ChangeHints:
    """The anchor's side of hints (sans-IO): whether to tell passive clients the mesh changed.

    The driver calls :meth:`next_check` when the view changed and :meth:`check` at that time; a hint is
    due when the routing key differs from the one last hinted, at most once per :data:`HINT_GAP_S`."""

    key: int | None = None
    sent: float = -math.inf

    def next_check(self, now: float) -> float:
        return max(now + HINT_DELAY_S, self.sent + HINT_GAP_S)

    def check(self, key: int, now: float) -> bool:
        if key == self.key:
            return False
        self.key, self.sent = key, now
        return True


# --- the client's side ---------------------------------------------------------------------------


def open_table(raw: bytes, issuer: str, mesh_id: str, now: float) -> RouteTable:
    """Verify a signed table from ``issuer`` (the member we asked) and decode it.

    Raises :class:`BadRouteTable` (oversized, stale, from the future, inconsistent),
    :class:`~meshllm.errors.WrongSigner`, :class:`~meshllm.errors.WrongMesh` or the signature and
    decode errors of :func:`~meshllm.identity.signing.verify`.
    """
    if len(raw) > TABLE_MAX_BYTES:
        raise BadRouteTable(f"route table of {len(raw)} bytes exceeds the {TABLE_MAX_BYTES}-byte cap")
    signed = decode_signed(raw, what="route table")
    table = verify(signed, ROUTES_DOMAIN, RouteTable, signer=node_public_key(issuer))
    if table.issuer != issuer:
        raise WrongSigner(f"route table names issuer {table.issuer[:8]}, but {issuer[:8]} signed it")
    if table.mesh_id != mesh_id:
        raise WrongMesh(f"route table of mesh {table.mesh_id}, not {mesh_id}")
    if table.issued > now + CLOCK_SKEW_S:
        raise BadRouteTable(f"route table issued {table.issued - now:.0f} s in the future")
    if now - table.issued > TABLE_MAX_AGE_S:
        raise BadRouteTable(f"route table issued {now - table.issued:.0f} s ago (older than {TABLE_MAX_AGE_S:.0f} s)")
    if version_of(table.entries) != table.version:
        raise BadRouteTable("route table version does not match its entries")
    ids = [e.node_id for e in table.entries]
    if len(set(ids)) != len(ids):
        raise BadRouteTable("route table lists a node twice")
    for node in ids:
        node_public_key(node)  # DecodeError unless it names a key
    return table


@dataclass(frozen=True, slots=True)
class TableAccepted:
    """A new table replaced the one held; ``added``/``removed`` name the members that came and went."""

    issuer: str
    version: str
    added: list[str]
    removed: list[str]


@dataclass(frozen=True, slots=True)
class TableRefused:
    """A reply from ``issuer`` was refused; nothing changed."""

    issuer: str
    reason: str


@dataclass
class RouteBook:
    """The client's side: the table it holds, whom to ask and when (sans-IO: the driver passes ``now``)."""

    node_id: str
    mesh_id: str
    rng: random.Random
    interval: float = PULL_INTERVAL_S
    table: RouteTable | None = None
    confirmed: float = 0.0
    """When an anchor last vouched for the table held (a new table or ``RoutesSame``)."""
    _next_pull: float = 0.0
    _pulled_at: float = -math.inf
    _delay: float = FOLLOW_S
    """How long after this pull the next one comes: doubles up to ``interval`` (see :data:`FOLLOW_S`)."""
    _last_demand: float = field(default=-math.inf)

    def ask(self) -> RoutesAsk:
        return RoutesAsk(self.table.version if self.table is not None else "")

    def due(self, now: float) -> bool:
        """Whether a pull is due now (the interval passed, or one was asked for)."""
        return now >= self._next_pull

    def pulled(self, now: float) -> None:
        """A pull was started: the next one is the current delay away (unless asked for sooner)."""
        self._delay = min(self._delay, self.interval)
        self._pulled_at, self._next_pull = now, now + self._delay
        self._delay = min(self.interval, self._delay * 2)

    def on_demand(self, now: float) -> bool:
        """Something suggests the table is out of date (a node failed, a model is unknown, a new anchor): pull
        now, or :data:`ON_DEMAND_MIN_S` after the last pull on demand (a burst of failures asks once or twice,
        and a demand is never lost to the long interval).

        Returns whether this scheduled a pull sooner than one already due."""
        at = max(now, self._last_demand + ON_DEMAND_MIN_S)
        if at >= self._next_pull:
            return False
        self._last_demand = self._next_pull = at
        return True

    def hinted(self, hint: RoutesChanged, now: float) -> bool:
        """Our anchor says the mesh changed: pull (as on demand) unless we hold the version it names."""
        if self.table is not None and self.table.version == hint.version:
            return False
        return self.on_demand(now)

    def busy(self, now: float) -> None:
        """A request was routed: the next pull comes at most :data:`BUSY_INTERVAL_S` after the last one."""
        self._next_pull = min(self._next_pull, max(now, self._pulled_at + min(BUSY_INTERVAL_S, self.interval)))

    def next_timer(self) -> float:
        return self._next_pull

    def receive(self, issuer: str, reply: RoutesReply, now: float) -> TableAccepted | TableRefused | None:
        """Apply ``issuer``'s reply: a verified newer table replaces ours; a bad one changes nothing."""
        if isinstance(reply, RoutesSame):
            if self.table is not None and reply.version == self.table.version:
                self.confirmed = now
            return None
        try:
            table = open_table(reply.table, issuer, self.mesh_id, now)
        except MeshllmError as exc:
            return TableRefused(issuer, f"{type(exc).__name__}: {exc}")
        held = self.table
        if held is not None and held.issuer == issuer and table.issued < held.issued:
            return TableRefused(issuer, "BadRouteTable: older than the table it sent before (a replay)")
        before = {e.node_id for e in held.entries} if held is not None else set()
        after = {e.node_id for e in table.entries} - {self.node_id}
        self.table, self.confirmed = table, now
        if before != after:  # members came or went: more may follow, so look again soon
            self._delay = FOLLOW_S
            self._next_pull = min(self._next_pull, now + FOLLOW_S)
        return TableAccepted(issuer, table.version, sorted(after - before), sorted(before - after))

    @property
    def stale_after(self) -> float:
        """A table no anchor vouched for this long is dropped (no routing to ghosts): two missed pulls."""
        return max(STALE_AFTER_S, 2.5 * self.interval)

    def entries(self, now: float) -> list[RouteEntry]:
        """The entries to route on; none once no anchor has vouched for them in :attr:`stale_after`."""
        if self.table is None or now - self.confirmed > self.stale_after:
            return []
        return [e for e in self.table.entries if e.node_id != self.node_id]

    def anchor_candidates(self, exclude: Iterable[str]) -> list[str]:
        """Members to anchor to, in random order (hosts and workers with an address; not ``exclude``)."""
        skip = set(exclude) | {self.node_id}
        pool = [e.node_id for e in self.entries(self.confirmed) if e.node_id not in skip and (e.listen or e.observed)]
        self.rng.shuffle(pool)
        return pool

    def addresses(self, node_id: str) -> list[str]:
        """Where the table says ``node_id`` listens (its own addresses, then the observed ones)."""
        for e in self.table.entries if self.table is not None else []:
            if e.node_id == node_id:
                return list(dict.fromkeys([*e.listen, *e.observed]))
        return []


def record_of(entry: RouteEntry, mesh_id: str, issuer: str) -> PeerRecord:
    """A stand-in peer record for routing (unsigned: never gossiped; the node proves itself when dialed).

    The issuer's row carries its RTT to every node, so the client's RTT matrix has the anchor's edges.
    """
    served = [ServedModel(name=m.name, context=m.context, engine=m.engine, id=m.id, tools=m.tools)
              for m in entry.models]
    return PeerRecord(
        node_id=entry.node_id, mesh_id=mesh_id, seq=0, membership_proof=b"", name=entry.name, role=entry.role,
        addresses=Addresses(listen=list(entry.listen), observed=list(entry.observed), relay=list(entry.relay)),
        models=Models(served=served), load=entry.load, standby=list(entry.standby),
    )


def view_of(book: RouteBook, previous: view.ViewState, now: float) -> view.ViewState:
    """The peer table a passive client routes on, built from the table it holds.

    Entries keep their ``changed`` time while they stay members (alive or suspect) or stay tombstones
    of the same kind; members the table no longer lists
    become ``down`` tombstones (so routers answer 503, not 404, for a model that just went), and are
    dropped after the stale period.
    """
    table = book.table
    issuer = table.issuer if table is not None else ""
    peers: dict[str, view.PeerEntry] = {}
    rows: dict[str, RttEntry] = {}
    entries = book.entries(now)
    for entry in entries:
        if entry.rtt_ms is not None:
            rows[entry.node_id] = RttEntry(entry.rtt_ms, "direct")
    for entry in entries:
        record = record_of(entry, book.mesh_id, issuer)
        if entry.node_id == issuer:
            record = msgspec.structs.replace(record, rtt=rows)
        old = previous.peers.get(entry.node_id)
        status: view.Status = entry.status
        if old is not None and old.status == status and old.record == record:
            peers[entry.node_id] = old  # unchanged: the same object, so diff reports nothing
            continue
        peers[entry.node_id] = view.PeerEntry(record, b"", status, view.changed_at(old, status, now), now)
    for node_id, old in previous.peers.items():
        if node_id in peers:
            continue
        if old.status in view.ACTIVE:
            peers[node_id] = view.PeerEntry(old.record, b"", "down", now, old.heard)
        elif now - old.changed <= STALE_AFTER_S:
            peers[node_id] = old
    return view.ViewState(previous.self_id, peers)


@dataclass
class PassiveView:
    """What a passive client knows of the mesh, with the query surface of :class:`~meshllm.mesh.gossip.Gossip`
    that the rest of the node reads (``own``, ``state``, ``members()``, ``rtt_matrix()``,
    ``update_own()``), so serving, routing, replay, status and splits run on it unchanged.

    Our own record is never signed or sent: nobody holds it.
    """

    own: PeerRecord
    state: view.ViewState
    connected: set[str] = field(default_factory=set)
    """Always empty: a passive client gossips with nobody."""

    @property
    def node_id(self) -> str:
        return self.own.node_id

    def members(self) -> dict[str, PeerRecord]:
        return view.members(self.state)

    def rtt_matrix(self) -> dict[str, dict[str, float]]:
        return rtt.rtt_matrix([self.own, *self.members().values()])

    def update_own(self, now: float, **changes: object) -> None:
        self.own = msgspec.structs.replace(self.own, signed_at=now, **changes)  # type: ignore[arg-type]

    def replace_state(self, state: view.ViewState) -> list[view.ViewEvent]:
        """Install a new peer table; returns the events from the old one to it."""
        old, self.state = self.state, state
        return view.diff(old, state)

