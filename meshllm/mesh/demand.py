"""The demand map: which models the mesh's clients ask for that their own node does not serve.

Sans-IO, ``now`` passed in. Each node counts, per model, the requests its API took that it could
not serve with a local engine (routed to a peer, or refused because nobody serves the model or
every server was full): :class:`DemandTracker`. Its counts over the last
:data:`DEMAND_WINDOW_S` travel in the node's own signed peer record (``PeerRecord.demand``), so a
member can report only its own demand, never inflate another's. :func:`mesh_demand` merges the
records a node holds: per origin the newest record wins (gossip keeps only the highest sequence),
per model the origins' counts add up and the latest ``last_active`` counts, and an entry whose
last request is older than :data:`DEMAND_TTL_S` is dropped. Standby nodes (``owner/standby.py``)
and published listings (``models_wanted``) read the result.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Iterable
from dataclasses import dataclass

from meshllm.mesh.records import MAX_DEMAND, DemandEntry, PeerRecord

DEMAND_WINDOW_S = 60.0
"""Requests are counted over this sliding window (the rate a standby compares with capacity)."""
DEMAND_TTL_S = 600.0
"""A model nobody asked for in this long leaves the demand map."""
MAX_MODEL_NAME = 200
"""Longer model names are not tracked (no node could serve them: records cap names the same way)."""
MAX_TRACKED = 4 * MAX_DEMAND
"""Models one tracker remembers; the least recently asked for goes first (a client inventing names
cannot grow it)."""
CLOCK_SKEW_S = 60.0
REPUBLISH_S = 10.0
"""A demand map that only drifted is republished at most this often (a record re-signed every couple
of seconds by every busy node would multiply gossip for little: standbys count recency in tens of seconds)."""


@dataclass
class _Counts:
    """One model's requests in one-second buckets over the window."""

    buckets: deque[tuple[int, int, int]]
    """``(second, requests, unmet)``, oldest first."""
    last_active: float


class DemandTracker:
    """This node's own demand: requests per model it could not serve locally."""

    def __init__(self, window_s: float = DEMAND_WINDOW_S, ttl_s: float = DEMAND_TTL_S) -> None:
        self.window_s = window_s
        self.ttl_s = ttl_s
        self._models: OrderedDict[str, _Counts] = OrderedDict()

    def record(self, model: str, now: float) -> None:
        """One request for ``model`` that this node will not serve itself."""
        if not model or len(model) > MAX_MODEL_NAME:
            return
        counts = self._models.get(model)
        if counts is None:
            counts = self._models[model] = _Counts(deque(), now)
        self._models.move_to_end(model)
        counts.last_active = max(counts.last_active, now)
        self._bump(counts, now, 1, 0)
        while len(self._models) > MAX_TRACKED:
            self._models.popitem(last=False)

    def unmet(self, model: str, now: float) -> None:
        """A request :meth:`record` counted was refused everywhere (nobody serves ``model``, or all were full)."""
        counts = self._models.get(model)
        if counts is not None:
            self._bump(counts, now, 0, 1)

    def _bump(self, counts: _Counts, now: float, requests: int, unmet: int) -> None:
        second = int(now)
        if counts.buckets and counts.buckets[-1][0] == second:
            _, r, u = counts.buckets.pop()
            requests, unmet = requests + r, unmet + u
        counts.buckets.append((second, requests, unmet))
        self._trim(counts, now)

    def entries(self, now: float) -> list[DemandEntry]:
        """The record's demand map: models asked for within the TTL, most recent first, at most :data:`MAX_DEMAND`."""
        for model in [m for m, c in self._models.items() if now - c.last_active > self.ttl_s]:
            del self._models[model]
        out = []
        for model, counts in reversed(self._models.items()):
            self._trim(counts, now)
            requests = sum(b[1] for b in counts.buckets)
            unmet = min(requests, sum(b[2] for b in counts.buckets))
            out.append(DemandEntry(model, requests, unmet, round(counts.last_active, 3)))
            if len(out) == MAX_DEMAND:
                break
        return out

    def _trim(self, counts: _Counts, now: float) -> None:
        while counts.buckets and counts.buckets[0][0] <= now - self.window_s:
            counts.buckets.popleft()


def worth_publishing(old: list[DemandEntry], new: list[DemandEntry], since_s: float) -> bool:
    """Whether a node should re-sign its record for a new demand map, ``since_s`` after the last one.

    At once when a model appears or goes, when refusals grew, or when a count changed by a quarter
    (and at least 2); a drift of counts and times waits for :data:`REPUBLISH_S`.
    """
    if old == new:
        return False
    before = {e.model: e for e in old}
    if set(before) != {e.model for e in new}:
        return True
    for entry in new:
        prior = before[entry.model]
        if entry.unmet > prior.unmet or abs(entry.requests - prior.requests) >= max(2, prior.requests // 4):
            return True
    return since_s >= REPUBLISH_S


@dataclass(frozen=True)
class ModelDemand:
    """The mesh's demand for one model, merged over every origin's record."""

    model: str
    requests: int
    """Requests in the origins' last windows that their own node did not serve."""
    unmet: int
    """Of them, refused everywhere (nobody serves the model, or every server was full)."""
    last_active: float
    """The latest such request anywhere."""
    origins: tuple[str, ...]
    """Nodes whose clients asked, sorted."""


def mesh_demand(entries: Iterable[tuple[str, Iterable[DemandEntry]]], now: float,
                ttl_s: float = DEMAND_TTL_S) -> dict[str, ModelDemand]:
    """Merge ``(origin node id, its demand entries)`` pairs; entries older than ``ttl_s`` are dropped.

    A ``last_active`` in the future (a fast clock) counts as ``now``.
    """
    merged: dict[str, tuple[int, int, float, set[str]]] = {}
    for origin, items in entries:
        for entry in items:
            last = min(entry.last_active, now)
            if now - last > ttl_s or entry.last_active > now + CLOCK_SKEW_S:
                continue
            requests, unmet, latest, origins = merged.get(entry.model, (0, 0, 0.0, set()))
            origins.add(origin)
            merged[entry.model] = (requests + entry.requests, unmet + entry.unmet, max(latest, last), origins)
    return {model: ModelDemand(model, r, u, last, tuple(sorted(o))) for model, (r, u, last, o) in merged.items()}


def record_demand(records: Iterable[PeerRecord], now: float, ttl_s: float = DEMAND_TTL_S) -> dict[str, ModelDemand]:
    """:func:`mesh_demand` over peer records (alive ones: the caller filters)."""
    return mesh_demand(((r.node_id, r.demand) for r in records), now, ttl_s)


def wanted_models(demand: dict[str, ModelDemand], served: Iterable[str], active_s: float = DEMAND_WINDOW_S,
                  now: float = 0.0) -> list[str]:
    """Models the mesh wants and cannot give now: asked for within ``active_s`` and served by nobody,
    or refused everywhere for lack of capacity. Sorted by the requests counted, then name."""
    have = set(served)
    wanted = [d for d in demand.values()
              if now - d.last_active <= active_s and d.requests and (d.model not in have or d.unmet)]
    return [d.model for d in sorted(wanted, key=lambda d: (-d.requests, d.model))]
