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

import math
import random
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from typing import Literal

from meshllm.mesh.records import PeerRecord

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
    """When ``status`` last changed (tombstones are forgotten relative to it)."""
    heard: float
    """When its sequence last advanced (a silent peer expires relative to it)."""
    notice: bytes | None = None
    """The signed down notice that killed it, resent to peers that still think it alive."""


@dataclass(frozen=True, slots=True)
class ViewState:
    """The whole peer table (never containing ourselves)."""

    self_id: str
    peers: Mapping[str, PeerEntry]


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
    return ViewState(self_id, {})


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
        changed = update.now if old is None or old.status != status else old.changed
        entry = PeerEntry(rec, update.raw, status, changed, update.now)
        return ViewState(state.self_id, {**state.peers, rec.node_id: entry})
    entry = state.peers.get(update.node_id)
    if entry is None:
        return state
    if isinstance(update, MarkSuspect) and entry.status == "alive":
        new = replace(entry, status="suspect", changed=update.now)
    elif isinstance(update, MarkAlive) and entry.status == "suspect":
        new = replace(entry, status="alive", changed=update.now)
    elif isinstance(update, MarkDown) and entry.status in ACTIVE and entry.record.seq == update.seq:
        new = replace(entry, status="down", changed=update.now, notice=update.notice)
    elif isinstance(update, MarkRevoked) and entry.status != "revoked":
        new = replace(entry, status="revoked", changed=update.now, notice=None)
    else:
        return state
    return ViewState(state.self_id, {**state.peers, update.node_id: new})


def _expire(state: ViewState, update: Expire) -> ViewState:
    peers: dict[str, PeerEntry] = {}
    touched = False
    for node, entry in state.peers.items():
        silent = min(entry.heard, entry.record.signed_at)  # a replayed old record is as old as its signature
        if entry.status in ACTIVE and update.now - silent > update.stale_after:
            peers[node] = replace(entry, status="down", changed=update.now)
            touched = True
        elif entry.status not in ACTIVE and update.now - entry.changed > update.forget_after:
            touched = True
        else:
            peers[node] = entry
    return ViewState(state.self_id, peers) if touched else state


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


def refresh_partial_view(
    current: frozenset[str], candidates: Iterable[str], size: int, rng: random.Random, rotate: bool
) -> frozenset[str]:
    """Keep still-valid entries, optionally swap one out (Cyclon-style churn), fill up at random.

    Every member knows every record, so sampling uniformly from the table gives the random graph
    Cyclon's shuffles approximate, without the shuffle protocol. The rotation keeps the overlay from
    freezing into one graph, so a partition in it heals.
    """
    pool = sorted(candidates)
    valid = set(pool)
    keep = sorted(p for p in current if p in valid)
    if rotate and keep:
        keep.remove(rng.choice(keep))
    kept = set(keep)
    fresh = [p for p in pool if p not in kept]
    keep += rng.sample(fresh, max(0, min(size - len(keep), len(fresh))))
    return frozenset(keep[:size] if len(keep) > size else keep)
