"""``GET /metrics``: the node in the Prometheus text format, through the ``prometheus_client`` library.

Two kinds of figures:

- **observed** as requests go (:class:`GenerationWatch`, driven by the mesh backend): requests and
  tokens per model and route (``local`` on this node's engine, ``routed`` to a peer, ``split`` on a
  chain of stages this node coordinates), time to first token and time between tokens;
- **read at scrape time** from the node's live state (:class:`NodeState`): queue depth and busy slots
  per local model, peers by state, RTT to each peer, stream bytes per kind, replays and failovers.

Each node has its own :class:`~prometheus_client.CollectorRegistry` (never the process-global one),
so several nodes in one process (tests) do not mix their figures. The route needs the admin token
or an API key, like the other management routes, unless the node runs with ``--metrics-public``.
Model labels only ever name models that some node served (a request for an unknown model counts
under ``meshllm_request_errors_total{route="none"}``), so a client cannot grow the label sets.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Literal

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from meshllm.engine.base import Engine, Finish, TextDelta
from meshllm.net.traffic import StreamTraffic
from meshllm.runtime.counters import RequestCounters

Route = Literal["local", "routed", "split"]

TTFT_BUCKETS = (0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
"""Seconds to the first token: a loopback tiny model lands in the first buckets, a WAN split in the last."""
INTER_TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)
"""Seconds between tokens: 1 ms (a tiny model) to 1 s (a slow chain of stages)."""


@dataclass(frozen=True)
class PeerState:
    """One peer as ``/metrics`` shows it."""

    node_id: str
    name: str
    state: str
    rtt_ms: float | None


@dataclass(frozen=True)
class NodeState:
    """Where the scrape-time figures come from (the node's live objects, read on each scrape)."""

    engines: Mapping[str, Engine]
    peers: Callable[[], list[PeerState]]
    traffic: StreamTraffic
    counters: RequestCounters


class NodeMetrics:
    """The node's registry: request and token figures observed as they happen, and the state collector."""

    def __init__(self, state: NodeState | None = None) -> None:
        self.registry = CollectorRegistry()
        labels = ["model", "route"]
        self.requests = Counter("meshllm_requests", "Requests that reached a model, by model and route",
                                labels, registry=self.registry)
        self.errors = Counter("meshllm_request_errors", "Requests that ended in an error, by route "
                              "(none: no node could take it)", ["route"], registry=self.registry)
        self.tokens = Counter("meshllm_tokens", "Tokens processed, by model, route and kind (prompt, completion)",
                              [*labels, "kind"], registry=self.registry)
        self.ttft = Histogram("meshllm_time_to_first_token_seconds", "From a request's arrival to its first token",
                              labels, buckets=TTFT_BUCKETS, registry=self.registry)
        self.inter_token = Histogram("meshllm_inter_token_seconds", "Time between a generation's tokens",
                                     labels, buckets=INTER_TOKEN_BUCKETS, registry=self.registry)
        if state is not None:
            self.registry.register(StateCollector(state))

    def watch(self, model: str, now: float) -> GenerationWatch:
        """Follow one request that arrived at ``now`` (seconds on any monotonic clock)."""
        return GenerationWatch(self, model, now)

    def render(self) -> bytes:
        """The registry in the Prometheus text format."""
        return generate_latest(self.registry)


@dataclass
class GenerationWatch:
    """One request's figures: its route once a target answers, then its tokens as they stream."""

    metrics: NodeMetrics
    model: str
    started: float
    route: Route | None = None
    _last: float | None = field(default=None, repr=False)

    def routed(self, route: Route) -> None:
        """The first target that answered serves it (a later replay keeps the route it started on)."""
        if self.route is None:
            self.route = route
            self.metrics.requests.labels(self.model, route).inc()

    def event(self, event: object, now: float) -> None:
        """One event that went to the client."""
        if self.route is None:
            return
        labels = (self.model, self.route)
        if isinstance(event, TextDelta) and event.tokens:
            if self._last is None:
                self.metrics.ttft.labels(*labels).observe(now - self.started)
            else:
                gap = (now - self._last) / len(event.tokens)
                histogram = self.metrics.inter_token.labels(*labels)
                for _ in event.tokens:
                    histogram.observe(gap)
            self._last = now
        elif isinstance(event, Finish):
            self.prompt_tokens(event.usage.prompt_tokens)
            self.metrics.tokens.labels(*labels, "completion").inc(event.usage.completion_tokens)

    def prompt_tokens(self, count: int) -> None:
        """Prompt tokens read (a generation's, from its finish; an embedding's inputs)."""
        if self.route is not None:
            self.metrics.tokens.labels(self.model, self.route, "prompt").inc(count)

    def failed(self) -> None:
        """The request ended in an error (``route="none"`` when no target ever answered)."""
        self.metrics.errors.labels(self.route or "none").inc()


class StateCollector(Collector):
    """Gauges and totals read from the node's live state at each scrape."""

    def __init__(self, state: NodeState) -> None:
        self.state = state

    def collect(self) -> Iterator[Metric]:
        queue = GaugeMetricFamily("meshllm_queue_depth", "Requests waiting for a slot, per local model",
                                  labels=["model"])
        busy = GaugeMetricFamily("meshllm_slots_busy", "Slots generating now, per local model", labels=["model"])
        slots = GaugeMetricFamily("meshllm_slots", "Slots (requests at once), per local model", labels=["model"])
        for model, engine in sorted(self.state.engines.items()):
            report = engine.load_report()
            queue.add_metric([model], report.queued)
            busy.add_metric([model], report.running)
            slots.add_metric([model], report.slots)
        yield from (queue, busy, slots)

        peers = self.state.peers()
        by_state = GaugeMetricFamily("meshllm_peers", "Peers this node knows, by state", labels=["state"])
        counts: dict[str, int] = dict.fromkeys(("alive", "suspect", "down"), 0)
        for peer in peers:
            counts[peer.state] = counts.get(peer.state, 0) + 1
        for state, count in sorted(counts.items()):
            by_state.add_metric([state], count)
        yield by_state
        rtt = GaugeMetricFamily("meshllm_peer_rtt_seconds", "Round-trip time to each measured peer",
                                labels=["peer", "name"])
        for peer in peers:
            if peer.rtt_ms is not None:
                rtt.add_metric([peer.node_id, peer.name], peer.rtt_ms / 1000.0)
        yield rtt

        moved = CounterMetricFamily("meshllm_stream_bytes", "Stream payload bytes over the mesh, by stream kind "
                                    "and direction", labels=["kind", "direction"])
        traffic = self.state.traffic
        for direction, totals in (("sent", traffic.sent), ("received", traffic.received)):
            for kind, size in sorted(totals.items()):
                moved.add_metric([kind, direction], size)
        yield moved

        counters = self.state.counters
        for name, doc, value in (
            ("meshllm_replays", "Generations continued on another node after theirs failed or stalled",
             counters.replays),
            ("meshllm_replays_failed", "Replays that found no node in time", counters.replays_failed),
            ("meshllm_failovers", "Targets skipped because they failed before their first byte", counters.failovers),
            ("meshllm_served_for_peers", "Requests peers sent to this node's engines", counters.served_for_peers),
        ):
            yield CounterMetricFamily(name, doc, value=value)
