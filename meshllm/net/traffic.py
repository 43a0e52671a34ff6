"""Bytes moved over the endpoint's streams, per stream kind and direction (for ``/metrics``).

Counted where stream bytes meet aioquic (:class:`~meshllm.net.streams.Stream`), so every kind is
covered: requests, stage lanes, model fetches, gossip, owner envelopes. An incoming stream's bytes
before its kind header is read count under ``""``. The mesh's gossip datagrams (probes, summaries)
count under ``gossip`` too (mesh/service.py), so that kind is all the gossip a node moves.
"""

from __future__ import annotations

from collections import Counter


class StreamTraffic:
    """Running totals of stream payload bytes (QUIC framing not included)."""

    def __init__(self) -> None:
        self.sent: Counter[str] = Counter()
        self.received: Counter[str] = Counter()

    def add_sent(self, kind: str | None, size: int) -> None:
        self.sent[kind or ""] += size

    def add_received(self, kind: str | None, size: int) -> None:
        self.received[kind or ""] += size

    def name_received(self, kind: str, size: int) -> None:
        """An incoming stream's kind is known: the ``size`` bytes it received so far were that kind's."""
        moved = min(size, self.received[""])
        self.received[""] -= moved
        self.received[kind] += moved
        if not self.received[""]:
            del self.received[""]
