"""MeshBackend: the node's :class:`~meshllm.runtime.backend.Backend`, serving every model of the mesh.

A request runs on this node's engine when it has the model; otherwise it travels to a peer over
a QUIC stream of kind ``"request"`` (the tunnel frames of :mod:`meshllm.runtime.tunnel`), and the
response streams back. Which targets, in which order, is the sans-IO :class:`~meshllm.runtime.router.Router`'s
decision; this module is its driver: it reads the mesh (gossip records, connections, RTTs),
walks the order with an :class:`~meshllm.runtime.router.Attempt` (failover until the first event has
gone to the client), and holds every wait to a deadline.

A peer that vanishes mid-response is noticed by the transport's probes (``suspect`` within about
a second) or a closed connection; both reset the streams in flight to it. A generation broken that
way after its first byte is *replayed*: the request and the token ids already sent go to another
node serving the same model file, which continues the answer where it broke, so the client's
stream goes on (:mod:`meshllm.runtime.replay` keeps the state and the rules). With nowhere to go the
client gets the clean error at once instead of waiting for a timeout.

Before the first event, *unreachable* is not taken for *gone*: a peer whose probes went unanswered
for a second, or whose handshake took longer than the dial's deadline, may be a host too loaded to
answer in time (measured: a node under attack on a busy 2-core host; handshakes with live members of
a 50-process mesh on two cores). When a request found nowhere to start only because the nodes serving
its model could not be reached (or are suspect), it tries again while gossip still holds one of them
alive or suspect, for up to :data:`START_WAIT_S`; a dead node's request gets its 503 after that
wait, or as soon as gossip has it down.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from meshllm.engine.base import (
    Embeddings,
    EmbedRequest,
    Engine,
    EngineBusy,
    Finish,
    GenerationEvent,
    GenerationRequest,
)
from meshllm.engine.embed import embed_stream
from meshllm.engine.recommended import admit
from meshllm.errors import DecodeError
from meshllm.identity.ids import short
from meshllm.mesh.records import PeerRecord, takes_requests
from meshllm.mesh.service import MeshService
from meshllm.net.connection import PeerConnection
from meshllm.net.errors import ConnectError, NetTimeout, StreamClosed
from meshllm.net.events import PeerEvent, PeerEventKind
from meshllm.net.streams import Stream
from meshllm.runtime.backend import ModelEntry, local_entry
from meshllm.runtime.counters import RequestCounters
from meshllm.runtime.errors import (
    ApiError,
    NoCapacity,
    Saturated,
    UnknownModel,
    UpstreamError,
    UpstreamTimeout,
    classify,
)
from meshllm.runtime.metrics import GenerationWatch, NodeMetrics, Route
from meshllm.runtime.replay import Progress, ReplayPolicy, seeded
from meshllm.runtime.router import Attempt, PeerView, Router, Target, affinity_key
from meshllm.runtime.tunnel import (
    STREAM_KIND,
    PeerOverran,
    RemoteError,
    Routable,
    ServerFrame,
    TunnelClient,
    TunnelEvent,
    failover_allowed,
)

log = logging.getLogger(__name__)


UNMET_STATUSES = frozenset({404, 429, 503})
"""A request refused with one of these had nowhere to go: nobody serves the model, or all were full."""


class DemandHook(Protocol):
    """What counts this node's demand (``meshllm.mesh.demand.DemandTracker``)."""

    def record(self, model: str, now: float) -> None: ...

    def unmet(self, model: str, now: float) -> None: ...


CONNECT_PATIENCE_MAX = 3
"""Most times ``connect_s`` a dial waits on a loaded host (a dead node's dial costs as much before failover)."""
START_WAIT_S = 10.0
"""Longest a request that could reach no node serving its model keeps trying, while gossip holds one alive."""
START_RETRY_S = 0.25
"""How often that wait looks at the mesh again (gossip and probes both decide when a node is routable)."""


@dataclass(frozen=True)
class TunnelDeadlines:
    """How long the caller waits at each step of a routed request."""

    connect_s: float = 3.0
    """Reaching the peer: dialing (when not connected), opening the stream, sending the request."""
    first_byte_s: float = 60.0
    """From the request sent to the first response frame (includes the peer's queue)."""
    idle_s: float = 30.0
    """Between two response frames."""
    total_s: float = 900.0
    """The whole response; also sent to the peer, which abandons the request after it."""


class Unreachable(UpstreamError):
    """A target that could not be reached, or stopped answering: it may be slow, not gone."""


class NoneReachable(NoCapacity):
    """No target to start on was reachable: none routable, or each :class:`Unreachable` or busy (not all
    busy: that is :class:`Saturated`, for the client to come back to)."""


@dataclass(frozen=True)
class _Leg:
    """The part of a generation one target serves: the target and its remaining events."""

    target: Target
    events: AsyncIterator[TunnelEvent]


@dataclass(eq=False)
class _Call:
    """A routed request in flight to one peer, so peer events can abort it."""

    node_id: str
    stream: Stream | None = None
    lost: str | None = None
    """Why the peer is considered gone (set by a peer event)."""

    def abort(self, why: str) -> None:
        self.lost = why
        if self.stream is not None:
            self.stream.reset()


@dataclass
class MeshBackend:
    """Lists and serves every model of the mesh: local engines first, then peers over QUIC."""

    node_id: str
    engines: Mapping[str, Engine]
    """This node's engines by model id (the live dict: models loaded later appear here)."""
    mesh: MeshService
    router: Router = field(init=False)
    deadlines: TunnelDeadlines = field(default_factory=TunnelDeadlines)
    counters: RequestCounters = field(default_factory=RequestCounters)
    replay: ReplayPolicy = field(default_factory=ReplayPolicy)
    hashes: Mapping[str, str] = field(default_factory=dict)
    """sha256 of each local engine's model file by model id (the live dict; absent while hashing)."""
    clock: Callable[[], float] = time.monotonic
    on_event: Callable[..., None] = field(default=lambda *_a, **_k: None)
    """``on_event(type, **fields)``: the node's event hub (failovers show in ``/api/events``)."""
    metrics: NodeMetrics | None = None
    """The node's ``/metrics`` registry (None: nothing observed)."""
    demand: DemandHook | None = None
    """Told of every request for a model this node does not serve, and of those that found nowhere to run
    (the owner's demand counter, published in the node's record; None: nothing counted)."""
    _calls: dict[str, set[_Call]] = field(default_factory=dict, init=False)
    _created: int = field(default_factory=lambda: int(time.time()), init=False)

    def __post_init__(self) -> None:
        self.router = Router(self.node_id)
        assert self.mesh.endpoint is not None, "start the mesh service before building its backend"
        self.mesh.endpoint.on_peer_event(self._on_peer_event)

    # ---- what the mesh serves ---------------------------------------------------------------

    def models(self) -> Sequence[ModelEntry]:
        """Local models, then those alive peers serve whole (layer ranges are not routable), each with the
        load of its nodes now (a peer's load is its record's, for all the models it serves)."""
        entries = {mid: local_entry(mid, engine, self.node_id, self._own_name(), self._created)
                   for mid, engine in sorted(self.engines.items()) if engine.listed}
        for node_id, record in sorted(self._alive_records().items()):
            load = record.load
            for model in record.models.served:
                if not takes_requests(model):
                    continue
                entry = entries.get(model.name) or ModelEntry(id=model.name, nodes=(), context_length=model.context,
                                                              created=self._created, tools=model.tools)
                entries[model.name] = dataclasses.replace(
                    entry, nodes=(*entry.nodes, node_id), node_names=(*entry.node_names, record.name or short(node_id)),
                    slots=entry.slots + load.slots, free_slots=entry.free_slots + load.free_slots,
                    busy=entry.busy + load.in_flight + load.queue, tok_s=max(entry.tok_s, load.tok_s))
        return [entries[mid] for mid in sorted(entries)]

    def _own_name(self) -> str:
        gossip = self.mesh.gossip
        return gossip.own.name if gossip is not None and gossip.own.name else short(self.node_id)

    def _alive_records(self) -> dict[str, PeerRecord]:
        gossip = self.mesh.gossip
        if gossip is None:
            return {}
        return {n: e.record for n, e in gossip.state.peers.items() if e.status == "alive" and n != self.node_id}

    def _peer_views(self) -> list[PeerView]:
        assert self.mesh.endpoint is not None and self.mesh.gossip is not None
        own_rtt = self.mesh.gossip.own.rtt
        views = []
        for node_id, record in self._alive_records().items():
            conn = self.mesh.endpoint.peers.get(node_id)
            rtt = conn.rtt_ms if conn is not None else None
            if rtt is None and node_id in own_rtt:
                rtt = own_rtt[node_id].rtt_ms
            ours = len(self._calls.get(node_id, ()))
            load = max(record.load.in_flight + record.load.queue, ours)
            # the record is up to a few seconds old: our own calls in flight may already fill its free slots
            free = max(0, record.load.free_slots - ours) if record.load.slots else None
            served = frozenset(m.name for m in record.models.served if takes_requests(m))
            views.append(PeerView(node_id=node_id, models=served, load=load, free_slots=free, rtt_ms=rtt,
                                  alive=conn is None or conn.state != "suspect"))
        return views

    def _local_free(self, model: str) -> int | None:
        """Free slots of this node's engine for ``model``: slots no request holds or waits for."""
        engine = self.engines.get(model)
        if engine is None:
            return None
        report = engine.load_report()
        return max(0, report.slots - report.running - report.queued)

    def _known_anywhere(self, model: str) -> bool:
        """Some member (alive, suspect or recently gone) serves ``model``: 503, not 404."""
        gossip = self.mesh.gossip
        return gossip is not None and any(
            model in {m.name for m in e.record.models.served} for e in gossip.state.peers.values())

    # ---- generation -------------------------------------------------------------------------

    async def generate(self, request: GenerationRequest) -> AsyncIterator[GenerationEvent]:
        """Stream ``request`` from the best target, failing over until the first event."""
        remote = self._count(request.model)
        watch = self._watch(request)
        started = False
        try:
            async for event in self._route(request, watch):
                if watch is not None:
                    watch.event(event, self.clock())
                started = True
                yield event
        except Exception as exc:
            self.counters.failed_one()
            if watch is not None:
                watch.failed()
            if remote and not started:
                self._unmet(request.model, exc)
            raise

    async def embed(self, request: EmbedRequest) -> Embeddings:
        """Embeddings from the best target, failing over like a generation (the answer is one event)."""
        remote = self._count(request.model)
        watch = self._watch(request)
        events = self._route(request, watch)
        try:
            answer = await _first(events, "the serving node")
            if not isinstance(answer, Embeddings):
                raise UpstreamError("the serving node answered an embeddings request with text")
        except Exception as exc:
            self.counters.failed_one()
            if watch is not None:
                watch.failed()
            if remote:
                self._unmet(request.model, exc)
            raise
        finally:
            await _aclose(events)
        if watch is not None:
            watch.prompt_tokens(answer.prompt_tokens)
        return answer

    def _count(self, model: str) -> bool:
        """Count a request for ``model`` (and, when this node does not serve it, its demand); whether it is remote."""
        now, remote = time.time(), model not in self.engines
        self.counters.started(now, remote=remote)
        if remote and self.demand is not None:
            self.demand.record(model, now)
        return remote

    def _unmet(self, model: str, exc: BaseException) -> None:
        """A request for a model served elsewhere ended before its answer: demand unmet if nobody could take it."""
        if self.demand is not None and classify(exc)[0] in UNMET_STATUSES:
            self.demand.unmet(model, time.time())

    def _watch(self, request: Routable) -> GenerationWatch | None:
        return None if self.metrics is None else self.metrics.watch(request.model, self.clock())

    def _route_of(self, target: Target, model: str) -> Route:
        """``/metrics``' route label: a peer, this node's split chain (announced as engine "split"), or local."""
        if not target.local:
            return "routed"
        gossip = self.mesh.gossip
        if gossip is not None and any(m.name == model and m.engine == "split" for m in gossip.own.models.served):
            return "split"
        return "local"

    async def _route(self, request: Routable, watch: GenerationWatch | None = None) -> AsyncIterator[TunnelEvent]:
        """The events of ``request``: fail over until the first event, then replay a generation whose
        serving node fails (or stalls) mid-answer on another node (:mod:`meshllm.runtime.replay`)."""
        if isinstance(request, EmbedRequest):
            target, first, events = await self._begin(request)
            if watch is not None:
                watch.routed(self._route_of(target, request.model))
            try:
                yield first
                async for event in events:
                    yield event
            except Exception:
                self.router.record_failure(target.node_id, self.clock())
                raise
            finally:
                await _aclose(events)
            self.router.record_success(target.node_id)
            return
        progress = Progress(seeded(request), self.replay)
        target, event, events = await self._begin(progress.request, progress)
        if watch is not None:
            watch.routed(self._route_of(target, request.model))
        leg = _Leg(target, events)
        try:
            while True:
                if progress.passes(event):
                    progress.sent(event, self.clock())
                    yield event
                if isinstance(event, Finish):
                    self.router.record_success(leg.target.node_id)
                    return
                try:
                    event, leg = await self._next(leg, progress)
                except StopAsyncIteration:
                    return
                except Exception as exc:
                    await _aclose(leg.events)
                    self.router.record_failure(leg.target.node_id, self.clock())
                    if progress.why_not(exc) is not None:
                        raise
                    if not self._candidates(progress.request, progress, self._left(progress, leg.target)):
                        self._nowhere(progress, leg.target, exc)
                        raise
                    target, event, events, _started = await self._replay(progress, leg.target, str(exc))
                    leg = _Leg(target, events)
        finally:
            await _aclose(leg.events)

    async def _next(self, leg: _Leg, progress: Progress) -> tuple[TunnelEvent, _Leg]:
        """The stream's next event. A stream silent past its stall delay is hedged: its replay starts
        elsewhere at once, and whichever of the two speaks first goes on (both give the same text)."""
        stall = progress.stall_s()
        if stall is None:
            return await anext(leg.events), leg
        pending = asyncio.ensure_future(anext(leg.events))
        hedge: asyncio.Future[tuple[Target, TunnelEvent, AsyncIterator[TunnelEvent], float]] | None = None
        try:
            await asyncio.wait({pending}, timeout=stall)  # from now: the client may have been slow to read
            if pending.done() or not self._candidates(progress.request, progress, self._left(progress, leg.target)):
                return await pending, leg
            silent = f"{self._name(leg.target)} sent nothing for {stall:.2f}s"
            hedge = asyncio.ensure_future(self._replay(progress, leg.target, silent, hedge=True))
            await asyncio.wait({pending, hedge}, return_when=asyncio.FIRST_COMPLETED)
            if pending.done() and pending.exception() is None:
                return pending.result(), leg  # the first node spoke first: the hedge is dropped (finally)
            await asyncio.wait({hedge})  # the first node failed, or the hedge answered first
            error, outcome, hedge = hedge.exception(), (None if hedge.exception() else hedge.result()), None
            if outcome is None:
                if pending.done():
                    raise error  # type: ignore[misc]  # both failed: the error names both
                return await pending, leg  # no replacement: the first node may still answer
            pending.cancel()
            with contextlib.suppress(BaseException):
                await pending
            await _aclose(leg.events)
            self.router.record_failure(leg.target.node_id, self.clock())
            progress.took_over(leg.target.node_id)
            target, first, events, started = outcome
            self._replayed(progress, leg.target, target, silent, len(progress.tokens), started)
            return first, _Leg(target, events)
        finally:
            if not pending.done() or hedge is not None:
                pending.cancel()
                with contextlib.suppress(BaseException):
                    await pending
            if hedge is not None:
                await self._drop(hedge, progress)

    async def _drop(self, hedge: asyncio.Future[tuple[Target, TunnelEvent, AsyncIterator[TunnelEvent], float]],
                    progress: Progress) -> None:
        """Stop a hedge the first node outran (its node cancels the request)."""
        hedge.cancel()
        with contextlib.suppress(BaseException):
            await hedge
        node_id = None
        if hedge.done() and not hedge.cancelled() and hedge.exception() is None:
            target, _first, events, _started = hedge.result()
            node_id = target.node_id
            await _aclose(events)
        self.counters.replays_dropped += 1
        self.on_event("request_replay_dropped", model=progress.request.model, node_id=node_id,
                      replay=progress.replays + progress.hedges, reason="the first node answered first")

    def _targets(self, request: Routable) -> list[Target]:
        """Where ``request`` can run, best first (empty: nowhere)."""
        model = request.model
        return self.router.order(model, local_models=self.engines.keys(), peers=self._peer_views(),
                                 now=self.clock(), key=affinity_key(request), local_free=self._local_free(model))

    async def _begin(self, request: Routable, progress: Progress | None = None,
                     exclude: frozenset[str] = frozenset()) -> tuple[Target, TunnelEvent, AsyncIterator[TunnelEvent]]:
        """:meth:`_start` on the current targets less ``exclude`` (the nodes a replayed answer left).

        When no target was reachable (none routable, or each one's dial or probes failed: a loaded host
        looks like a dead one for a few seconds) while gossip still holds a member serving the model
        alive or suspect, it looks again every :data:`START_RETRY_S` for up to :data:`START_WAIT_S`,
        each try dialing with one more ``connect_s`` of patience (at most :data:`CONNECT_PATIENCE_MAX`, and
        no longer than the wait has left).
        A member gossip has down is not waited for."""
        try:
            return await self._start(request, self._candidates(request, progress, exclude), progress)
        except NoneReachable as exc:
            nowhere = exc
        awaited = self._announcing(request.model, exclude)
        if not awaited:
            raise nowhere
        log.info("%s: no node reachable (%s); trying up to %gs more for %s", request.model, nowhere, START_WAIT_S,
                 ", ".join(sorted(self._name(Target(n)) for n in awaited)))
        started, tries = self.clock(), 1

        def waited(routable: bool) -> None:
            self.on_event("request_waited", model=request.model, nodes=sorted(awaited),
                          waited_s=round(self.clock() - started, 3), routable=routable)

        while self.clock() - started < START_WAIT_S and self._announcing(request.model, exclude):
            await asyncio.sleep(START_RETRY_S)
            if not (targets := self._candidates(request, progress, exclude)):
                continue
            tries += 1
            left_s = START_WAIT_S - (self.clock() - started)
            try:
                begun = await self._start(request, targets, progress,
                                          patience=max(1.0, min(tries, left_s / self.deadlines.connect_s)))
            except NoneReachable as exc:
                nowhere = exc
                continue
            waited(True)
            return begun
        waited(False)
        raise nowhere

    def _announcing(self, model: str, exclude: frozenset[str]) -> frozenset[str]:
        """Members other than ``exclude`` that serve ``model``, that gossip holds alive or suspect, and that
        this node has not cut off for overstepping its limits."""
        gossip, endpoint = self.mesh.gossip, self.mesh.endpoint
        if gossip is None or endpoint is None:
            return frozenset()
        return frozenset(
            node_id for node_id, entry in gossip.state.peers.items()
            if node_id != self.node_id and node_id not in exclude and entry.status in ("alive", "suspect")
            and not endpoint.cooling(node_id)
            and any(m.name == model and takes_requests(m) for m in entry.record.models.served))

    async def _start(self, request: Routable, targets: Sequence[Target], progress: Progress | None = None,
                     patience: float = 1.0) -> tuple[Target, TunnelEvent, AsyncIterator[TunnelEvent]]:
        """The first target of ``targets`` that answers: it, its first event, and the rest of its events.

        A target that fails before its first event (and not because of the request) is skipped. A dial
        waits ``patience`` times ``connect_s`` (or more on a loaded host: :meth:`_connection`).
        """
        if not targets:
            if self._known_anywhere(request.model):
                raise NoneReachable(f"no reachable node serves {request.model!r} right now "
                                 "(the nodes serving it are unreachable or gone)")
            raise UnknownModel(f"model {request.model!r} is not served by this mesh")
        attempt = Attempt(targets, self.router)
        failures: list[tuple[Target, BaseException]] = []
        while (target := attempt.next_target()) is not None:
            events = self._open(target, request, progress, patience)
            try:
                first = await _first(events, self._name(target))
            except Exception as exc:
                await _aclose(events)
                if not failover_allowed(exc):
                    raise
                attempt.failed(self.clock())
                failures.append((target, exc))
                self.counters.failovers += 1
                self.on_event("request_failover", model=request.model, node_id=target.node_id,
                              error=str(exc), status=classify(exc)[0])
                continue
            attempt.first_byte()
            if progress is not None and target.local and not progress.model_sha256:
                progress.model_sha256 = self.hashes.get(request.model)
            return target, first, events
        raise self._exhausted(request.model, failures)

    def _candidates(self, request: Routable, progress: Progress | None, exclude: frozenset[str]) -> list[Target]:
        """:meth:`_targets` less ``exclude``, and less this node when ``progress`` is pinned to a model file
        (the first node named its sha256) that this node's file is not."""
        pin = progress.model_sha256 if progress is not None else None
        return [t for t in self._targets(request) if t.node_id not in exclude
                and not (t.local and pin and self.hashes.get(request.model) != pin)]

    def _left(self, progress: Progress, failed: Target) -> frozenset[str]:
        """The nodes ``progress``'s generation may not continue on after ``failed``: those that failed it."""
        return frozenset(progress.failed | {failed.node_id})

    def _nowhere(self, progress: Progress, failed: Target, exc: Exception) -> None:
        """Report a generation that broke with no other node to continue it (the client gets ``exc``)."""
        self.counters.replays_impossible += 1
        why = f"no other node serves {progress.request.model!r}"
        self.on_event("request_not_replayed", model=progress.request.model, node_id=failed.node_id, error=str(exc),
                      reason=why)
        log.warning("%s failed mid-answer and %s: %s", self._name(failed), why, exc)

    async def _replay(self, progress: Progress, failed: Target, reason: str, *,
                      hedge: bool = False) -> tuple[Target, TunnelEvent, AsyncIterator[TunnelEvent], float]:
        """Continue ``progress``'s generation on the first other node that answers (:meth:`_begin`), after
        ``failed`` broke (or, ``hedge``, stalled: ``reason``): it, its first event, its other events, when
        the replay started. An :class:`UpstreamError` naming both failures when none answers in time."""
        exclude = self._left(progress, failed)
        request = progress.begin(failed.node_id, hedge=hedge)
        model, tokens, name = request.model, len(request.continuation), self._name(failed)
        self.counters.replays += 1
        self.on_event("request_replay", model=model, node_id=failed.node_id, error=reason, tokens=tokens,
                      replay=progress.replays + progress.hedges, hedge=hedge)
        started = self.clock()
        try:
            async with asyncio.timeout(self.replay.first_event_s):
                target, first, events = await self._begin(request, progress, exclude)
        except Exception as again:
            self.counters.replays_failed += 1
            why = f"no first event within {self.replay.first_event_s:g}s" if isinstance(again, TimeoutError) \
                else str(again)
            self.on_event("request_replay_failed", model=model, node_id=failed.node_id, error=why,
                          replay=progress.replays + progress.hedges)
            log.warning("%s broke mid-answer (%s); continuing it elsewhere failed too: %s", name, reason, why)
            raise UpstreamError(f"{reason}; continuing the answer on another node failed: {why}") from again
        if not hedge:  # a hedge is reported when it takes over
            self._replayed(progress, failed, target, reason, tokens, started)
        return target, first, events, started

    def _replayed(self, progress: Progress, failed: Target, target: Target, reason: str, tokens: int,
                  started: float) -> None:
        """Report a replay that took over the generation."""
        took_ms = round((self.clock() - started) * 1000)
        self.on_event("request_replayed", model=progress.request.model, node_id=target.node_id,
                      from_node_id=failed.node_id, tokens=tokens, replay=progress.replays + progress.hedges,
                      took_ms=took_ms)
        log.info("%s broke mid-answer (%s); %s continues it after %d tokens (%d ms)", self._name(failed), reason,
                 self._name(target), tokens, took_ms)

    def _exhausted(self, model: str, failures: list[tuple[Target, BaseException]]) -> ApiError:
        """The error after every target failed: a timeout stays 504; every node busy is a 429 with
        Retry-After (the client should come back); anything else is a 503, a :class:`NoneReachable` one
        (:meth:`_begin` tries again) when some could not be reached and the others were busy."""
        why = "; ".join(f"{self._name(t)}: {e}" for t, e in failures)
        if failures and isinstance(failures[-1][1], UpstreamTimeout):
            return UpstreamTimeout(f"every node serving {model!r} failed ({why})")
        if failures and all(_busy(e) for _, e in failures):
            hints = [e.retry_after_s for _, e in failures if isinstance(e, EngineBusy)]
            return Saturated(f"every node serving {model!r} is busy ({why})", retry_after_s=min(hints, default=1.0))
        if any(isinstance(e, Unreachable) for _, e in failures) and \
                all(isinstance(e, Unreachable) or _busy(e) for _, e in failures):
            return NoneReachable(f"every node serving {model!r} failed ({why})")
        return NoCapacity(f"every node serving {model!r} failed ({why})")

    def _open(self, target: Target, request: Routable, progress: Progress | None,
              patience: float = 1.0) -> AsyncIterator[TunnelEvent]:
        if not target.local:
            return self._remote(target.node_id, request, progress, patience)
        engine = self.engines[request.model]
        if isinstance(request, EmbedRequest):
            return embed_stream(engine, request)
        return engine.generate(admit(engine, request))

    def _name(self, target: Target) -> str:
        if target.local:
            return "this node"
        record = self._alive_records().get(target.node_id)
        return f"node {record.name if record is not None and record.name else short(target.node_id)}"

    async def _remote(self, node_id: str, request: Routable, progress: Progress | None,
                      patience: float = 1.0) -> AsyncIterator[TunnelEvent]:
        """One request through the tunnel to ``node_id``; every wait has a deadline.

        A replay (``progress`` holding the first node's model sha256) may only run on that file; the
        first node's sha256, when it tells it, is kept in ``progress`` for later replays.
        """
        dl = self.deadlines
        name = self._name(Target(node_id))
        call = _Call(node_id)
        self._calls.setdefault(node_id, set()).add(call)
        client = TunnelClient()
        conn: PeerConnection | None = None
        try:
            conn = await self._connection(node_id, name, patience)
            call.stream = await conn.open_stream(STREAM_KIND)
            pin = progress.model_sha256 if progress is not None else None  # known once a first node spoke
            opening = client.start(uuid.uuid4().hex, request, int(dl.total_s * 1000), pin or "",
                                   self._context(node_id, request.model))
            await call.stream.send(opening, timeout=dl.connect_s)
            end = self.clock() + dl.total_s
            wait = dl.first_byte_s
            while not client.done:
                try:
                    frame = await call.stream.recv(ServerFrame, timeout=max(0.0, min(wait, end - self.clock())))
                except NetTimeout:
                    if end - self.clock() <= 0:
                        raise UpstreamTimeout(f"{name} did not finish within {dl.total_s:g}s") from None
                    what = "first byte" if wait == dl.first_byte_s else "next token"
                    raise UpstreamTimeout(f"{name} sent no {what} within {wait:g}s") from None
                if frame is None:
                    client.stream_ended()
                    return
                event = client.receive(frame)
                if progress is not None and not progress.model_sha256 and client.model_sha256:
                    progress.model_sha256 = client.model_sha256
                yield event
                wait = dl.idle_s
        except StreamClosed as exc:
            raise Unreachable(f"{name} {call.lost or f'dropped the request ({exc})'}; retry the request") from None
        except (PeerOverran, DecodeError) as exc:  # a peer that oversteps its answer is cut off and struck
            log.warning("%s sent a bad answer, cut off: %s", name, exc)
            if call.stream is not None:
                call.stream.reset()
            if conn is not None:
                conn.strike(f"request tunnel: {exc}")
            if isinstance(exc, PeerOverran):
                raise PeerOverran(f"{name} {exc}") from None
            raise UpstreamError(f"{name} sent a malformed answer: {exc}") from None
        finally:
            self._calls[node_id].discard(call)
            if not self._calls[node_id]:
                del self._calls[node_id]
            if call.stream is not None:
                _hang_up(call.stream, client)

    def _context(self, node_id: str, model: str) -> int | None:
        """The context ``node_id``'s record announces for ``model`` (None: not known)."""
        record = self._alive_records().get(node_id)
        contexts = [m.context for m in record.models.served if m.name == model] if record is not None else []
        return max(contexts, default=None)

    async def _connection(self, node_id: str, name: str, patience: float = 1.0) -> PeerConnection:
        """The open connection to ``node_id``, dialing its gossiped addresses if there is none, for
        ``patience`` times ``connect_s`` or what the host's load asks, whichever is longer."""
        assert self.mesh.endpoint is not None
        record = self._alive_records().get(node_id)
        addrs = [] if record is None else [*record.addresses.listen, *record.addresses.observed]
        # A loaded host (local health above 0) gives the handshake longer, at most CONNECT_PATIENCE_MAX
        # times: on 54 processes sharing two cores, handshakes with live members took over 3 s.
        patience = min(max(self.mesh.endpoint.patience(node_id), patience), CONNECT_PATIENCE_MAX)
        if cut_off_s := self.mesh.endpoint.cooling(node_id):  # not Unreachable: no request waits for it
            raise UpstreamError(f"{name} is cut off for {cut_off_s:.0f} s (it overstepped this node's limits)")
        try:
            return await self.mesh.endpoint.connect_node(node_id, addrs, self.deadlines.connect_s * patience)
        except ConnectError as exc:
            raise Unreachable(f"cannot reach {name} ({exc})") from None

    def _on_peer_event(self, event: PeerEvent) -> None:
        """A peer turned suspect or its connection closed: abort what is in flight to it."""
        if event.kind in (PeerEventKind.SUSPECT, PeerEventKind.CLOSED):
            why = "became unreachable (no answer to its probes)" \
                if event.kind is PeerEventKind.SUSPECT else \
                f"became unreachable (connection closed: {event.reason or 'no reason'})"
            for call in list(self._calls.get(event.node_id, ())):
                call.abort(why)


def _busy(exc: BaseException) -> bool:
    """The target refused because all its slots or queue places are taken (it works; it is full)."""
    return isinstance(exc, EngineBusy) or (isinstance(exc, RemoteError) and exc.code == "no_capacity")


def _hang_up(stream: Stream, client: TunnelClient) -> None:
    """End our side: after a complete response, close; otherwise ask the peer to stop, then close."""
    try:
        if not client.done:
            stream.send_nowait(client.cancel())
        stream.close()
    except StreamClosed:
        pass



async def _first(events: AsyncIterator[TunnelEvent], name: str) -> TunnelEvent:
    try:
        return await anext(events)
    except StopAsyncIteration:
        raise UpstreamError(f"{name} ended the response without a result") from None


async def _aclose(events: AsyncIterator[TunnelEvent]) -> None:
    """Close ``events``. One still running is being read by a task this request has just cancelled
    (a hedged read whose client went away before it ended): that cancellation closes it as it goes
    through, and closing it here would raise."""
    if getattr(events, "ag_running", False):
        return
    close = getattr(events, "aclose", None)
    if close is not None:
        await close()
