"""RTT rows and the mesh-wide RTT matrix, as pure functions over immutable values.

Each node measures RTT only to the peers it is connected to (the transport's datagram probes) and
publishes that row in its record. The planner needs distances between *any* two nodes, so the
matrix is the union of every verified record's row; where only one direction was measured (A
connects to B but B's row lacks A) the other direction is filled in, since a QUIC RTT is symmetric.
Rows are republished only on a significant change so RTT jitter does not turn into gossip traffic.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from meshllm.mesh.records import PathKind, PeerRecord, RttEntry


@dataclass(frozen=True, slots=True)
class Sample:
    """The latest measurement to one peer."""

    rtt_ms: float
    path: PathKind
    at: float


RttTable = Mapping[str, Sample]


def observe_rtt(table: RttTable, peer: str, rtt_ms: float, path: PathKind, now: float) -> RttTable:
    """The table with ``peer``'s latest sample (the transport already smooths it)."""
    return {**table, peer: Sample(float(rtt_ms), path, now)}


def current_row(table: RttTable, now: float, max_age: float) -> dict[str, RttEntry]:
    """The row to publish: samples younger than ``max_age``, rounded to 0.1 ms (jitter is noise)."""
    return {
        peer: RttEntry(round(s.rtt_ms, 1), s.path)
        for peer, s in sorted(table.items())
        if now - s.at <= max_age
    }


def row_changed(
    published: Mapping[str, RttEntry], row: Mapping[str, RttEntry], rel: float = 0.2, abs_ms: float = 2.0
) -> bool:
    """True when ``row`` differs enough from ``published`` to be worth a new record.

    A change counts when a peer appears or disappears, the path kind changes, or an RTT moves by
    more than ``rel`` of its value *and* more than ``abs_ms`` (small LAN RTTs jitter by 100%).
    """
    if published.keys() != row.keys():
        return True
    for peer, new in row.items():
        old = published[peer]
        delta = abs(new.rtt_ms - old.rtt_ms)
        if old.path != new.path or (delta > rel * old.rtt_ms and delta > abs_ms):
            return True
    return False


def rtt_matrix(records: Iterable[PeerRecord]) -> dict[str, dict[str, float]]:
    """``{a: {b: ms}}`` over the given records' rows, with symmetric fill of missing directions.

    Only rows between nodes present in ``records`` are kept, so a departed peer's stale distances
    never reach the planner.
    """
    recs = list(records)
    known = {r.node_id for r in recs}
    matrix: dict[str, dict[str, float]] = {n: {} for n in sorted(known)}
    for rec in recs:
        for peer, entry in rec.rtt.items():
            if peer in known and peer != rec.node_id:
                matrix[rec.node_id][peer] = entry.rtt_ms
    for a, row in matrix.items():
        for b, ms in row.items():
            matrix[b].setdefault(a, ms)
    return matrix
