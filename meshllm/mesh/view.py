"""The peer table as a value: ``apply(state, update) -> state`` and nothing else changes it.

Like exo's shared state, the table is immutable; gossip and the failure detector describe what they
learned as small update objects and :func:`apply` computes the next table. A rejected input never
reaches :func:`apply`, so there is no half-applied change, and :func:`diff` turns two tables into
the events the rest of the node reacts to.

Down and left peers stay in the table as tombstones (with the sequence they died at) for
``forget_after`` seconds, so an old copy of their record still circulating is refused as stale
instead of resurrecting them. The partial view (which peers to keep connections to) is computed
here too, by :func:`refresh_partial_view`.
"""

from __future__ import annotations

import functools
import hashlib
import math
import random
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, replace
from typing import Any, Literal

from meshllm.mesh.records import REFRESH_S, PeerRecord

Status = Literal["alive", "suspect", "down", "left", "revoked"]
ACTIVE: frozenset[Status] = frozenset({"alive", "suspect"})


@dataclass(frozen=True, slots=True)
class PeerEntry:
    """What we hold about one peer."""

    record: PeerRecord
    """Its newest verified record."""
    raw: bytes
    """The record's signed bytes, resent as-is in gossip."""
    status: Status
    changed: float
    """When the peer last joined or left our membership (alive and suspect are both members, so a
    suspicion changes nothing here; a tombstone's kind does): tombstones are forgotten relative to it,
    and ``/api/status`` reports how long ago it was (``changed_s``)."""
    heard: float
    """When its sequence last advanced (a silent peer expires relative to it)."""
    notice: bytes | None = None
    """The signed down notice that killed it, resent to peers that still think it alive."""


# --- the table: a persistent map with per-bucket summaries ---

BUCKET_BITS = 4
"""A node id's bucket at each level is 4 bits of its key (one base32 character's low bits)."""
LEVELS = 3
"""Levels of the table's trie: 16, 256 and 4,096 buckets; a summary names the sums of one level."""
_ALPHABET = "abcdefghijklmnopqrstuvwxyz234567"
_NIBBLE = {c: i & 15 for i, c in enumerate(_ALPHABET)}


@functools.lru_cache(maxsize=1 << 16)
def bucket_path(node_id: str) -> tuple[int, ...]:
    """The node's bucket at each level: the low 4 bits of the first characters of its base32 id.

    Node ids are their public keys in base32, so these bits are uniform: every member, honest or
    not, files an id under the same buckets without hashing it. (Any other string gets a
    deterministic path too, so a digest of garbage ids costs no more than one of real ones.)
    """
    return tuple(_NIBBLE.get(c, ord(c) & 15) for c in node_id[:LEVELS].ljust(LEVELS, "a"))


def bucket_of(node_id: str, level: int) -> int:
    """Index of the node's bucket among the ``16 ** level`` buckets of ``level``."""
    index = 0
    for nibble in bucket_path(node_id)[:level]:
        index = index * 16 + nibble
    return index


def entry_hash(node_id: str, seq: int, active: bool) -> int:
    """What a peer's version contributes to its bucket's sum (XORed in, so order does not matter)."""
    data = f"{node_id}/{seq}/{int(active)}".encode()
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")


_EMPTY_LEAF: tuple[int, int, Mapping[str, PeerEntry]] = (0, 0, {})
_EMPTY_INNER: tuple[int, int, tuple] = (0, 0, (None,) * 16)


class Table(Mapping[str, "PeerEntry"]):
    """The peer table: an immutable map from node id to entry, copied by path, summed per bucket.

    A 16-ary trie of depth :data:`LEVELS` over :func:`bucket_path`; each trie node carries the XOR
    of :func:`entry_hash` over everything under it, and how many entries it holds (for
    :meth:`sample`). Storing one entry copies one path (three small
    tuples and one bucket of about N/4096 entries) instead of the whole table, and keeps every
    level's sums current, so a summary of 10,000 peers costs a walk over 256 integers, not a pass
    over 10,000 records. Tables that share history share structure.
    """

    __slots__ = ("_len", "_root", "active")

    def __init__(self, root: tuple = _EMPTY_INNER, length: int = 0, active: int = 0) -> None:
        self._root, self._len = root, length
        self.active = active
        """How many entries are alive or suspect (members), without a pass over the table."""

    @classmethod
    def of(cls, entries: Mapping[str, PeerEntry]) -> Table:
        if isinstance(entries, Table):
            return entries
        table = cls()
        for node, entry in entries.items():
            table = table.set(node, entry)
        return table

    def __getitem__(self, node: str) -> PeerEntry:
        trie: Any = self._root
        for nibble in bucket_path(node):
            trie = trie[2][nibble]
            if trie is None:
                raise KeyError(node)
        return trie[2][node]

    def __len__(self) -> int:
        return self._len

    def __iter__(self) -> Iterator[str]:
        for leaf in self._leaves(self._root, LEVELS):
            yield from leaf[2]

    def items(self) -> Iterator[tuple[str, PeerEntry]]:  # type: ignore[override]
        """Every (node id, entry), bucket by bucket (no lookup per key)."""
        for leaf in self._leaves(self._root, LEVELS):
            yield from leaf[2].items()

    def values(self) -> Iterator[PeerEntry]:  # type: ignore[override]
        for leaf in self._leaves(self._root, LEVELS):
            yield from leaf[2].values()

    def _leaves(self, trie: tuple, depth: int) -> Iterator[tuple]:
        if depth == 0:
            yield trie
            return
        for child in trie[2]:
            if child is not None:
                yield from self._leaves(child, depth - 1)

    def set(self, node: str, entry: PeerEntry) -> Table:
        """A table with ``node`` mapped to ``entry``."""
        return self._put(node, entry)

    def remove(self, node: str) -> Table:
        """A table without ``node`` (the same table if it had none)."""
        return self._put(node, None) if node in self else self

    def _put(self, node: str, entry: PeerEntry | None) -> Table:
        path = bucket_path(node)
        spine: list[tuple] = [self._root]
        for nibble in path:
            child = spine[-1][2][nibble]
            spine.append(child if child is not None else _EMPTY_LEAF if len(spine) == LEVELS else _EMPTY_INNER)
        leaf_sum, leaf_count, leaf = spine[-1]
        old = leaf.get(node)
        delta = 0 if old is None else _hash(node, old)
        length, active = self._len - (old is not None), self.active - (old is not None and old.status in ACTIVE)
        entries = {k: v for k, v in leaf.items() if k != node}
        if entry is not None:
            entries[node] = entry
            delta ^= _hash(node, entry)
            length, active = length + 1, active + (entry.status in ACTIVE)
        grown = length - self._len
        trie: tuple = (leaf_sum ^ delta, leaf_count + grown, entries)
        for depth in range(LEVELS - 1, -1, -1):
            parent_sum, parent_count, children = spine[depth]
            kids = list(children)
            kids[path[depth]] = trie
            trie = (parent_sum ^ delta, parent_count + grown, tuple(kids))
        return Table(trie, length, active)

    def sample(self, rng: random.Random, k: int, accept: Callable[[str, PeerEntry], bool]) -> list[str]:
        """Up to ``k`` distinct ids drawn uniformly from the entries ``accept`` takes.

        Draws by position (the trie knows every subtree's size), so picking a few peers out of
        10,000 costs a few walks down the trie, not a list of the table; when ``accept`` refuses
        most draws it falls back to one pass over the table.
        """
        chosen: list[str] = []
        seen: set[str] = set()
        for _ in range(4 * k + 16):
            if len(chosen) >= k or len(seen) >= self._len:
                break
            node, entry = self._nth(rng.randrange(self._len))
            if node not in seen:
                seen.add(node)
                if accept(node, entry):
                    chosen.append(node)
        if len(chosen) < k:
            rest = [n for n, e in self.items() if n not in seen and accept(n, e)]
            chosen += rng.sample(rest, min(k - len(chosen), len(rest)))
        return chosen

    def _nth(self, index: int) -> tuple[str, PeerEntry]:
        trie: Any = self._root
        for _ in range(LEVELS):
            for child in trie[2]:
                if child is not None:
                    if index < child[1]:
                        trie = child
                        break
                    index -= child[1]
        for i, item in enumerate(trie[2].items()):
            if i == index:
                return item
        raise IndexError(index)

    def sums(self, level: int) -> list[int]:
        """The ``16 ** level`` bucket sums of ``level`` (1 to :data:`LEVELS`), in bucket order."""
        nodes: list[tuple | None] = [self._root]
        for _ in range(level):
            nodes = [child for n in nodes for child in (n[2] if n is not None else (None,) * 16)]
        return [0 if n is None else n[0] for n in nodes]

    def bucket_sum(self, level: int, bucket: int) -> int:
        """The sum of one bucket of ``level`` (0 when empty)."""
        trie: Any = self._root
        for shift in range(level - 1, -1, -1):
            trie = trie[2][(bucket >> (4 * shift)) & 15]
            if trie is None:
                return 0
        return trie[0]

    def in_buckets(self, level: int, buckets: Iterable[int]) -> Iterator[tuple[str, PeerEntry]]:
        """Entries filed under the given buckets of ``level``."""
        for bucket in buckets:
            trie: Any = self._root
            for shift in range(level - 1, -1, -1):
                trie = trie[2][(bucket >> (4 * shift)) & 15]
                if trie is None:
                    break
            if trie is not None:
                for leaf in self._leaves(trie, LEVELS - level):
                    yield from leaf[2].items()


def _hash(node: str, entry: PeerEntry) -> int:
    return entry_hash(node, entry.record.seq, entry.status in ACTIVE)


@dataclass(frozen=True, slots=True)
class ViewState:
    """The whole peer table (never containing ourselves)."""

    self_id: str
    peers: Table
    """Given any mapping, it is filed into a :class:`Table`."""

    def __post_init__(self) -> None:
        if not isinstance(self.peers, Table):
            object.__setattr__(self, "peers", Table.of(self.peers))


# --- updates (inputs to apply) ---


@dataclass(frozen=True, slots=True)
class RecordStored:
    """A verified, strictly newer record was accepted."""

    record: PeerRecord
    raw: bytes
    now: float


@dataclass(frozen=True, slots=True)
class MarkSuspect:
    """The failure detector (or the transport) suspects the peer."""

    node_id: str
    now: float


@dataclass(frozen=True, slots=True)
class MarkAlive:
    """The peer answered again; clears a suspicion."""

    node_id: str
    now: float


@dataclass(frozen=True, slots=True)
class MarkDown:
    """A down notice (ours or a verified one) for the peer at exactly ``seq``, the version we hold.

    A notice naming a later sequence than ours is ignored too: we cannot tell whether the peer ever
    signed it, and accepting it would let an accuser name a sequence the peer can never exceed.
    """

    node_id: str
    seq: int
    notice: bytes
    now: float


@dataclass(frozen=True, slots=True)
class MarkRevoked:
    """The mesh key revoked the peer (its node id or its invite): a tombstone nothing revives."""

    node_id: str
    now: float


@dataclass(frozen=True, slots=True)
class Expire:
    """Housekeeping: peers silent for ``stale_after`` go down; tombstones older than ``forget_after`` go.

    Silence counts from when the peer's sequence last advanced here or from when its newest record
    was signed, whichever is earlier: a replayed record starts out as old as its signature.
    """

    now: float
    stale_after: float
    forget_after: float


Update = RecordStored | MarkSuspect | MarkAlive | MarkDown | MarkRevoked | Expire


def empty(self_id: str) -> ViewState:
    """A table that knows nobody."""
    return ViewState(self_id, Table())


def held_seq(state: ViewState, node_id: str) -> int | None:
    """The sequence we hold for a peer, tombstones included (the staleness bar for its records)."""
    entry = state.peers.get(node_id)
    return None if entry is None else entry.record.seq


def apply(state: ViewState, update: Update) -> ViewState:
    """The table after ``update``; ``state`` is not modified."""
    if isinstance(update, Expire):
        return _expire(state, update)
    if isinstance(update, RecordStored):
        rec = update.record
        if rec.node_id == state.self_id:
            return state
        status: Status = "left" if rec.state == "leaving" else "alive"
        old = state.peers.get(rec.node_id)
        entry = PeerEntry(rec, update.raw, status, changed_at(old, status, update.now), update.now)
        return ViewState(state.self_id, state.peers.set(rec.node_id, entry))
    entry = state.peers.get(update.node_id)
    if entry is None:
        return state
    if isinstance(update, MarkSuspect) and entry.status == "alive":
        new = replace(entry, status="suspect")
    elif isinstance(update, MarkAlive) and entry.status == "suspect":
        new = replace(entry, status="alive")
    elif isinstance(update, MarkDown) and entry.status in ACTIVE and entry.record.seq == update.seq:
        new = replace(entry, status="down", changed=update.now, notice=update.notice)
    elif isinstance(update, MarkRevoked) and entry.status != "revoked":
        new = replace(entry, status="revoked", changed=update.now, notice=None)
    else:
        return state
    return ViewState(state.self_id, state.peers.set(update.node_id, new))


def changed_at(old: PeerEntry | None, status: Status, now: float) -> float:
    """``PeerEntry.changed`` for an entry now in ``status`` that was ``old`` (None: new to us)."""
    if old is None or (old.status != status and not (old.status in ACTIVE and status in ACTIVE)):
        return now
    return old.changed


def deadline(entry: PeerEntry, stale_after: float, forget_after: float) -> float:
    """When ``entry`` changes by itself: a silent member goes down, a tombstone is forgotten.

    Silence counts from when the peer's sequence last advanced here or from when its newest record
    was signed, whichever is earlier. Both limits stretch by however much longer than
    :data:`~meshllm.mesh.records.REFRESH_S` the peer's signed record says it waits between
    re-signs (large meshes refresh records less often, see ``Gossip.refresh_period``). A member
    nobody probes is the only one this ever takes down: the failure detectors take a dead member
    down within seconds (``mesh/failure.py``).
    """
    extra = max(0.0, entry.record.refresh - REFRESH_S)
    if entry.status in ACTIVE:
        return min(entry.heard, entry.record.signed_at) + stale_after + extra
    return entry.changed + forget_after + extra


def _expire(state: ViewState, update: Expire) -> ViewState:
    peers = state.peers
    for node, entry in state.peers.items():
        if update.now > deadline(entry, update.stale_after, update.forget_after):
            if entry.status in ACTIVE:
                peers = peers.set(node, replace(entry, status="down", changed=update.now))
            else:
                peers = peers.remove(node)
    return state if peers is state.peers else ViewState(state.self_id, peers)


def members(state: ViewState) -> dict[str, PeerRecord]:
    """Records of the peers we consider in the mesh (alive or suspect)."""
    return {n: e.record for n, e in state.peers.items() if e.status in ACTIVE}


# --- events (outputs, computed by diff) ---


@dataclass(frozen=True, slots=True)
class PeerAdded:
    """A peer joined our view (new, or back after being down)."""

    node_id: str
    record: PeerRecord


@dataclass(frozen=True, slots=True)
class RecordUpdated:
    """A member published a newer record."""

    node_id: str
    record: PeerRecord


@dataclass(frozen=True, slots=True)
class PeerStatus:
    """A member turned suspect or alive again (routers avoid suspects)."""

    node_id: str
    status: Status


@dataclass(frozen=True, slots=True)
class PeerRemoved:
    """A member left our view; ``reason`` is ``down``, ``left`` or ``revoked``."""

    node_id: str
    reason: Status


ViewEvent = PeerAdded | RecordUpdated | PeerStatus | PeerRemoved


def diff(old: ViewState, new: ViewState, nodes: Iterable[str] | None = None) -> list[ViewEvent]:
    """Events that turn ``old`` into ``new``, for ``nodes`` (default: every peer)."""
    if old is new:
        return []
    out: list[ViewEvent] = []
    for node in sorted(set(old.peers) | set(new.peers)) if nodes is None else nodes:
        before, after = old.peers.get(node), new.peers.get(node)
        if before is after:
            continue
        was = before is not None and before.status in ACTIVE
        now_active = after is not None and after.status in ACTIVE
        if after is not None and now_active and not was:
            out.append(PeerAdded(node, after.record))
        elif was and after is not None and not now_active:
            out.append(PeerRemoved(node, after.status))
        elif was and now_active and before is not None and after is not None:
            if after.record is not before.record:
                out.append(RecordUpdated(node, after.record))
            if after.status != before.status:
                out.append(PeerStatus(node, after.status))
    return out


def view_size(n_members: int, extra: int = 3) -> int:
    """Random partial-view size: ceil(log2(N)) + k, HyParView's rule of thumb for connectivity."""
    return math.ceil(math.log2(max(n_members, 1) + 1)) + extra


Draw = Callable[[int, set[str]], list[str]]
"""``draw(k, taken)``: up to ``k`` distinct candidates chosen uniformly at random, none in ``taken``."""


def draw_from(pool: Iterable[str], rng: random.Random) -> Draw:
    """A :data:`Draw` over a plain collection of candidates."""
    ordered = sorted(pool)
    return lambda k, taken: rng.sample(fresh := [p for p in ordered if p not in taken], max(0, min(k, len(fresh))))


def refresh_partial_view(
    current: frozenset[str], valid: Callable[[str], bool], draw: Draw, size: int, rng: random.Random, rotate: bool
) -> frozenset[str]:
    """Keep still-valid entries, optionally swap one out (Cyclon-style churn), fill up at random.

    Every member knows every record, so sampling uniformly from the table gives the random graph
    Cyclon's shuffles approximate, without the shuffle protocol. The rotation keeps the overlay from
    freezing into one graph, so a partition in it heals.
    """
    keep = sorted(p for p in current if valid(p))
    if rotate and keep:
        keep.remove(rng.choice(keep))
    if len(keep) < size:
        keep += draw(size - len(keep), set(keep))
    return frozenset(keep[:size] if len(keep) > size else keep)
