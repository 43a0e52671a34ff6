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


RTT_HYSTERESIS = 4.0
"""A published RTT changes only when the measured one leaves [published / 4, published * 4]: round trips
on a loaded host swing 3-7x from one measurement to the next (seen on 127.0.0.1 with 2 busy cores). It
orders nodes a continent apart, not a rack."""
RTT_FLOOR_MS = 10.0
"""RTTs below this count as this: nodes nearer than 10 ms are alike to requests that take seconds, and
round trips on one busy host swing between 0.4 and 25 ms (measured on 127.0.0.1, 2 loaded cores)."""


def within_band(ms: float, held: float) -> bool:
    """Whether ``ms`` is no news against ``held``: both floored at :data:`RTT_FLOOR_MS`, within
    :data:`RTT_HYSTERESIS` of each other."""
    ms, held = max(ms, RTT_FLOOR_MS), max(held, RTT_FLOOR_MS)
    return held / RTT_HYSTERESIS <= ms <= held * RTT_HYSTERESIS


ROW_FILL = 8
"""Below this many published peers, a newly measured one is news: a young node's row fills at once."""


def row_changed(published: Mapping[str, RttEntry], row: Mapping[str, RttEntry]) -> bool:
    """True when ``row`` differs enough from ``published`` to be worth a new record.

    A change counts when a published peer's path kind changes or its RTT leaves the band around the
    published value (:func:`within_band`), or when a new peer appears while the published row has fewer
    than :data:`ROW_FILL` entries. Every record carries a row, and each re-sign floods the mesh:

    - 16 processes on one loaded host re-signed every record about once a second on jitter alone when
      a 20 % move counted;
    - in a mesh of 50, partial views rotate and connections come and go, and counting every peer that
      joined or left the row re-signed some record 15 times a second. Past :data:`ROW_FILL` peers a row
      already places its node; who else it measures waits for the periodic refresh.
    """
    if len(published) < ROW_FILL and row.keys() - published.keys():
        return True
    return any(peer in published and (published[peer].path != new.path
                                      or not within_band(new.rtt_ms, published[peer].rtt_ms))
               for peer, new in row.items())


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
