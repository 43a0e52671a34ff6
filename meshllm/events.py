"""The node's events: one typed struct per kind, and the hub every part reports through.

Every part of a node reports what happened as a :class:`NodeEvent`: a tagged struct whose tag is
the event's ``type`` on the wire. Parts below the hub (the mesh, transfers, splits, owner control)
report through a callback ``on_event(type, **fields)`` rather than importing this module's types
into their hot paths; :meth:`EventHub.publish` turns that into the typed event (an unknown type or
field is an error, and ``tests/test_events.py`` checks that every type the code publishes is here).
Readers decide from the types, never from strings: ``/health`` follows :class:`ModelLoadingEvent`,
:class:`ModelReadyEvent`, :class:`Ready` and :class:`Stopping`; the console's refresh and board
triggers come from :attr:`NodeEvent.refreshes` and :attr:`NodeEvent.board` (``events_module_js``);
``meshllm status`` styles an event by :attr:`NodeEvent.style`.

On the wire (the JSON log, ``/api/events``) an event is ``{"type", "ts", **fields}`` with its fields
in declaration order and unset ones left out (:meth:`NodeEvent.wire`): exactly what the node sent
before the types existed, so scripts that read the log keep working.

Events go to three readers: the log (pretty or one JSON object per line), the ``/api/events``
server-sent-event stream, and tests. Subscribers get a bounded queue: a slow reader loses its
oldest events, it never slows the node down.

The history is what a reader that connects late is told first, so it keeps what happened to the
node (``ready``, ``peer_joined``, ``model_ready``, ...), not the gossip heartbeat: every member's
record refresh is a ``record_updated`` event, a few a second on a busy mesh, and kept in the history
they would push everything else out of it within a minute. Those are :attr:`NodeEvent.live_only`.
"""

from __future__ import annotations

import asyncio
import collections
import json
import time
from collections.abc import Callable, Mapping
from typing import Any, ClassVar

import msgspec
from msgspec import UNSET, UnsetType


def _now() -> float:
    return round(time.time(), 3)


class NodeEvent(msgspec.Struct, kw_only=True, tag_field="type"):
    """One thing that happened to the node; subclasses are the kinds, their tag the wire ``type``."""

    ts: float = msgspec.field(default_factory=_now)

    live_only: ClassVar[bool] = False
    """Streamed to subscribers but kept out of the history (the gossip heartbeat)."""
    refreshes: ClassVar[bool] = False
    """Changes what ``/api/status`` or ``/v1/models`` show: the console reloads them."""
    board: ClassVar[bool] = False
    """Changes the blackboard: the console reloads it while it is open."""
    style: ClassVar[str] = "bold"
    """How ``meshllm status`` draws the event's type (a rich style)."""

    @property
    def type(self) -> str:
        """The event's wire ``type`` (its tag)."""
        return str(self.__struct_config__.tag)

    def details(self) -> dict[str, Any]:
        """The fields beyond ``type`` and ``ts`` that are set, in declaration order."""
        return {name: value for name in self.__struct_fields__[1:]
                if (value := getattr(self, name)) is not UNSET}

    def wire(self) -> dict[str, Any]:
        """``{"type", "ts", **fields}``: the JSON log's and ``/api/events``' form."""
        return {"type": self.type, "ts": self.ts, **self.details()}


class Unrecognised(NodeEvent, kw_only=True, tag="unrecognised"):
    """An event of a type this version does not know (read from a newer node's stream), kept as sent."""

    kind: str = ""
    fields: dict[str, Any] = msgspec.field(default_factory=dict)

    @property
    def type(self) -> str:
        return self.kind

    def details(self) -> dict[str, Any]:
        return dict(self.fields)


# ---- the node --------------------------------------------------------------------------------------

class Ready(NodeEvent, kw_only=True, tag="ready"):
    """The node serves: its API is up, its models loaded (``/health`` turns 200)."""

    api_url: str | UnsetType = UNSET
    node_id: str | UnsetType = UNSET
    mesh_id: str | UnsetType = UNSET
    mesh_addr: str | UnsetType = UNSET
    name: str | UnsetType = UNSET
    role: str | UnsetType = UNSET
    invite: str | UnsetType | None = UNSET


class Stopping(NodeEvent, kw_only=True, tag="stopping"):
    """The node is leaving (``/health`` turns 503)."""

    node_id: str | UnsetType = UNSET


class MeshReady(NodeEvent, kw_only=True, tag="mesh_ready"):
    mesh_id: str | UnsetType = UNSET
    mesh_addr: str | UnsetType = UNSET


class MeshFound(NodeEvent, kw_only=True, tag="mesh_found"):
    mesh_id: str | UnsetType = UNSET
    name: str | UnsetType = UNSET
    via: str | UnsetType = UNSET
    bootstrap: list[str] | UnsetType = UNSET
    auto: bool | UnsetType = UNSET
    dht_bootstrap_from: str | UnsetType = UNSET


# ---- the mesh --------------------------------------------------------------------------------------

class PeerJoined(NodeEvent, kw_only=True, tag="peer_joined"):
    refreshes = True
    style = "green"
    node_id: str | UnsetType = UNSET
    name: str | UnsetType = UNSET


class PeerLeft(NodeEvent, kw_only=True, tag="peer_left"):
    refreshes = True
    style = "dim"
    node_id: str | UnsetType = UNSET
    reason: str | UnsetType = UNSET
    accuser: str | UnsetType = UNSET
    silent_s: float | UnsetType = UNSET


class PeerState(NodeEvent, kw_only=True, tag="peer_state"):
    refreshes = True
    style = "yellow"
    node_id: str | UnsetType = UNSET
    state: str | UnsetType = UNSET


class PeerConnected(NodeEvent, kw_only=True, tag="peer_connected"):
    refreshes = True
    node_id: str | UnsetType = UNSET
    path: str | UnsetType = UNSET


class PeerPath(NodeEvent, kw_only=True, tag="peer_path"):
    refreshes = True
    node_id: str | UnsetType = UNSET
    path: str | UnsetType = UNSET


class PeerCooled(NodeEvent, kw_only=True, tag="peer_cooled"):
    node_id: str | UnsetType = UNSET
    reason: str | UnsetType = UNSET


class RecordUpdated(NodeEvent, kw_only=True, tag="record_updated"):
    """A member refreshed its record: a few a second on a busy mesh, so never kept in the history."""

    live_only = True
    node_id: str | UnsetType = UNSET
    seq: int | UnsetType = UNSET


class RecordRejected(NodeEvent, kw_only=True, tag="record_rejected"):
    source: str | UnsetType = UNSET
    error: str | UnsetType = UNSET
    reason: str | UnsetType = UNSET


class Admitted(NodeEvent, kw_only=True, tag="admitted"):
    admitter: str | UnsetType = UNSET


class AnchorConnected(NodeEvent, kw_only=True, tag="anchor_connected"):
    """A passive client (``mesh/passive.py``) connected to a member it pulls route tables from."""

    refreshes = True
    style = "green"
    node_id: str | UnsetType = UNSET


class AnchorLost(NodeEvent, kw_only=True, tag="anchor_lost"):
    refreshes = True
    style = "yellow"
    node_id: str | UnsetType = UNSET
    reason: str | UnsetType = UNSET


class RoutesUpdated(NodeEvent, kw_only=True, tag="routes_updated"):
    """A passive client installed a newer route table."""

    refreshes = True
    style = "dim"
    issuer: str | UnsetType = UNSET
    version: str | UnsetType = UNSET
    nodes: int | UnsetType = UNSET
    added: list[str] | UnsetType = UNSET
    removed: list[str] | UnsetType = UNSET


class RoutesRefused(NodeEvent, kw_only=True, tag="routes_refused"):
    style = "red"
    issuer: str | UnsetType = UNSET
    reason: str | UnsetType = UNSET


class AccuserBanned(NodeEvent, kw_only=True, tag="accuser_banned"):
    node_id: str | UnsetType = UNSET


class Revoked(NodeEvent, kw_only=True, tag="revoked"):
    kind: str | UnsetType = UNSET
    target: str | UnsetType = UNSET
    source: str | UnsetType = UNSET


class Punch(NodeEvent, kw_only=True, tag="punch"):
    node_id: str | UnsetType = UNSET
    ok: bool | UnsetType = UNSET


class RelayReserved(NodeEvent, kw_only=True, tag="relay_reserved"):
    relay: str | UnsetType = UNSET
    addr: str | UnsetType = UNSET


class RelayCircuit(NodeEvent, kw_only=True, tag="relay_circuit"):
    source: str | UnsetType = UNSET
    target: str | UnsetType = UNSET
    circuit: Any = UNSET


class _NoteEvent(NodeEvent, kw_only=True):
    board = True
    id: str | UnsetType = UNSET
    author: str | UnsetType = UNSET
    name: str | UnsetType = UNSET
    source: str | UnsetType = UNSET


class NotePosted(_NoteEvent, kw_only=True, tag="note_posted"):
    """A note of ours was accepted onto the blackboard."""


class NoteReceived(_NoteEvent, kw_only=True, tag="note_received"):
    """A peer's note was accepted onto the blackboard."""


class NoteRefused(NodeEvent, kw_only=True, tag="note_refused"):
    source: str | UnsetType = UNSET
    author: str | UnsetType = UNSET
    code: str | UnsetType = UNSET
    reason: str | UnsetType = UNSET


# ---- models served here ----------------------------------------------------------------------------

class ModelEvent(NodeEvent, kw_only=True):
    """An event about one model (``model``: its id)."""

    model: str | UnsetType = UNSET


class ModelLoadingEvent(ModelEvent, kw_only=True):
    """The model is on its way here (loading, being placed, or replanned): not ready for requests."""


class ModelReadyEvent(ModelEvent, kw_only=True):
    """The model serves here now."""


class ModelFetching(ModelEvent, kw_only=True, tag="model_fetching"):
    reason: str | UnsetType = UNSET


class ModelLoading(ModelLoadingEvent, kw_only=True, tag="model_loading"):
    path: str | UnsetType = UNSET
    engine: str | UnsetType = UNSET
    size_bytes: int | UnsetType = UNSET


class ModelReady(ModelReadyEvent, kw_only=True, tag="model_ready"):
    refreshes = True
    style = "cyan"
    engine: str | UnsetType = UNSET
    context: int | UnsetType = UNSET
    slots: int | UnsetType = UNSET
    load_s: float | UnsetType = UNSET


class ModelDraining(ModelEvent, kw_only=True, tag="model_draining"):
    in_flight: int | UnsetType = UNSET
    timeout_s: float | UnsetType = UNSET


class ModelUnloaded(ModelEvent, kw_only=True, tag="model_unloaded"):
    refreshes = True
    drained: int | UnsetType = UNSET
    cancelled: int | UnsetType = UNSET
    waited_s: float | UnsetType = UNSET


# ---- requests --------------------------------------------------------------------------------------

class AutoRouted(ModelEvent, kw_only=True, tag="auto_routed"):
    reason: str | UnsetType = UNSET


class RequestFailover(ModelEvent, kw_only=True, tag="request_failover"):
    node_id: str | UnsetType = UNSET
    error: str | UnsetType = UNSET
    status: int | UnsetType = UNSET


class RequestWaited(ModelEvent, kw_only=True, tag="request_waited"):
    nodes: list[str] | UnsetType = UNSET
    waited_s: float | UnsetType = UNSET
    routable: bool | UnsetType = UNSET


class RequestNotReplayed(ModelEvent, kw_only=True, tag="request_not_replayed"):
    node_id: str | UnsetType = UNSET
    error: str | UnsetType = UNSET
    reason: str | UnsetType = UNSET


class RequestReplay(ModelEvent, kw_only=True, tag="request_replay"):
    node_id: str | UnsetType = UNSET
    error: str | UnsetType = UNSET
    tokens: int | UnsetType = UNSET
    replay: int | UnsetType = UNSET
    hedge: bool | UnsetType = UNSET


class RequestReplayDropped(ModelEvent, kw_only=True, tag="request_replay_dropped"):
    node_id: str | UnsetType = UNSET
    replay: int | UnsetType = UNSET
    reason: str | UnsetType = UNSET


class RequestReplayFailed(ModelEvent, kw_only=True, tag="request_replay_failed"):
    node_id: str | UnsetType = UNSET
    error: str | UnsetType = UNSET
    replay: int | UnsetType = UNSET


class RequestReplayed(ModelEvent, kw_only=True, tag="request_replayed"):
    node_id: str | UnsetType = UNSET
    from_node_id: str | UnsetType = UNSET
    tokens: int | UnsetType = UNSET
    replay: int | UnsetType = UNSET
    took_ms: int | UnsetType = UNSET


# ---- model transfers -------------------------------------------------------------------------------

class TransferEvent(ModelEvent, kw_only=True):
    """A transfer of model bytes (``id``: the model's id; ``layers``: a stage's range, or None)."""

    id: str | UnsetType = UNSET


class TransferStarted(TransferEvent, kw_only=True, tag="transfer_started"):
    kind: str | UnsetType = UNSET
    layers: list[int] | UnsetType | None = UNSET
    holders: Any = UNSET


class TransferProgress(TransferEvent, kw_only=True, tag="transfer_progress"):
    kind: str | UnsetType = UNSET
    layers: list[int] | UnsetType | None = UNSET
    bytes_done: int | UnsetType = UNSET
    bytes_total: int | UnsetType = UNSET
    rate_bytes_s: float | UnsetType = UNSET


class TransferDone(TransferEvent, kw_only=True, tag="transfer_done"):
    kind: str | UnsetType = UNSET
    layers: list[int] | UnsetType | None = UNSET
    bytes: int | UnsetType = UNSET
    fetched: int | UnsetType = UNSET
    took_s: float | UnsetType = UNSET
    path: str | UnsetType = UNSET
    holders: Any = UNSET


class TransferFailed(TransferEvent, kw_only=True, tag="transfer_failed"):
    kind: str | UnsetType = UNSET
    layers: list[int] | UnsetType | None = UNSET
    reason: str | UnsetType = UNSET


class TransferHolderDropped(TransferEvent, kw_only=True, tag="transfer_holder_dropped"):
    layers: list[int] | UnsetType | None = UNSET
    holder: str | UnsetType = UNSET
    reason: str | UnsetType = UNSET
    bad_bytes: int | UnsetType = UNSET


class HubPieceDisagreed(TransferEvent, kw_only=True, tag="hub_piece_disagreed"):
    offset: int | UnsetType = UNSET
    length: int | UnsetType = UNSET
    bad_source: str | UnsetType = UNSET


class TransferChannelFallback(NodeEvent, kw_only=True, tag="transfer_channel_fallback"):
    holder: str | UnsetType = UNSET
    reason: str | UnsetType = UNSET


# ---- splits ----------------------------------------------------------------------------------------

class SplitFromHub(ModelEvent, kw_only=True, tag="split_from_hub"):
    id: str | UnsetType = UNSET
    spec: str | UnsetType = UNSET
    size: int | UnsetType = UNSET
    header_bytes: int | UnsetType = UNSET
    fetched: Any = UNSET


class SplitPlacing(ModelLoadingEvent, kw_only=True, tag="split_placing"):
    mode: str | UnsetType = UNSET
    stages: Any = UNSET


class SplitWaiting(ModelLoadingEvent, kw_only=True, tag="split_waiting"):
    reason: str | UnsetType = UNSET


class SplitStageFailed(ModelLoadingEvent, kw_only=True, tag="split_stage_failed"):
    refreshes = True
    stage: int | UnsetType = UNSET
    failed_node: str | UnsetType = UNSET
    reason: str | UnsetType = UNSET


class SplitStageFetched(ModelEvent, kw_only=True, tag="split_stage_fetched"):
    node: str | UnsetType = UNSET
    layers: list[int] | UnsetType = UNSET
    bytes: int | UnsetType = UNSET
    bad_holders: Any = UNSET


class SplitReady(ModelReadyEvent, kw_only=True, tag="split_ready"):
    refreshes = True
    stages: Any = UNSET
    predicted_ms: float | UnsetType = UNSET
    took_s: float | UnsetType = UNSET


class SplitSparesReady(ModelEvent, kw_only=True, tag="split_spares_ready"):
    spares: Any = UNSET
    failed: Any = UNSET
    chain: Any = UNSET
    covered: Any = UNSET


class SplitReplay(ModelEvent, kw_only=True, tag="split_replay"):
    stage: int | UnsetType = UNSET
    failed_node: str | UnsetType = UNSET
    tokens: int | UnsetType = UNSET
    replay: int | UnsetType = UNSET


class SplitReplayFailed(ModelEvent, kw_only=True, tag="split_replay_failed"):
    error: str | UnsetType = UNSET
    replay: int | UnsetType = UNSET


class SplitReplayed(ModelEvent, kw_only=True, tag="split_replayed"):
    stages: int | UnsetType = UNSET
    tokens: int | UnsetType = UNSET
    replay: int | UnsetType = UNSET
    took_ms: int | UnsetType = UNSET
    passes: int | UnsetType = UNSET


class SplitForgery(ModelEvent, kw_only=True, tag="split_forgery"):
    style = "red"
    session: str | UnsetType = UNSET
    verdict: str | UnsetType = UNSET
    reason: str | UnsetType = UNSET
    nodes: Any = UNSET
    names: Any = UNSET
    stages: Any = UNSET
    token_index: Any = UNSET
    received_token: Any = UNSET
    expected_token: Any = UNSET
    evidence: Any = UNSET


# ---- owner control and standby ---------------------------------------------------------------------

class OwnerCommand(NodeEvent, kw_only=True, tag="owner_command"):
    op: str | UnsetType = UNSET
    model: str | UnsetType | None = UNSET
    key: Any = UNSET
    owner: str | UnsetType = UNSET


class OwnerDone(NodeEvent, kw_only=True, tag="owner_done"):
    op: str | UnsetType = UNSET
    model: str | UnsetType | None = UNSET
    ok: bool | UnsetType = UNSET
    code: str | UnsetType = UNSET
    message: str | UnsetType = UNSET


class OwnerRefused(NodeEvent, kw_only=True, tag="owner_refused"):
    style = "red"
    code: str | UnsetType = UNSET
    reason: str | UnsetType = UNSET
    sender: str | UnsetType = UNSET


class OwnerRelayed(NodeEvent, kw_only=True, tag="owner_relayed"):
    target: str | UnsetType = UNSET
    source: str | UnsetType = UNSET


class StandbyPromote(ModelEvent, kw_only=True, tag="standby_promote"):
    refreshes = True
    reason: str | UnsetType = UNSET


class StandbyDemote(ModelEvent, kw_only=True, tag="standby_demote"):
    refreshes = True
    idle_s: float | UnsetType = UNSET


class StandbyFailed(ModelEvent, kw_only=True, tag="standby_failed"):
    error: str | UnsetType = UNSET


# ---- discovery -------------------------------------------------------------------------------------

class Published(NodeEvent, kw_only=True, tag="published"):
    refreshes = True
    mesh_id: str | UnsetType = UNSET
    name: str | UnsetType = UNSET
    dht: Any = UNSET
    lan: Any = UNSET


class Unpublished(NodeEvent, kw_only=True, tag="unpublished"):
    refreshes = True
    mesh_id: str | UnsetType = UNSET
    ttl_s: float | UnsetType = UNSET


class DhtReady(NodeEvent, kw_only=True, tag="dht_ready"):
    multiaddrs: Any = UNSET


class DhtFailed(NodeEvent, kw_only=True, tag="dht_failed"):
    error: str | UnsetType = UNSET


def _kinds() -> dict[str, type[NodeEvent]]:
    found: dict[str, type[NodeEvent]] = {}
    todo: list[type[NodeEvent]] = [NodeEvent]
    while todo:
        cls = todo.pop()
        todo.extend(cls.__subclasses__())
        tag = cls.__struct_config__.tag
        if isinstance(tag, str) and tag != cls.__name__ and cls is not Unrecognised:  # not an abstract base
            found[tag] = cls
    return dict(sorted(found.items()))


KINDS: Mapping[str, type[NodeEvent]] = _kinds()
"""Every event type by its wire name."""


def typed_event(type_: str, **fields: Any) -> NodeEvent:
    """The typed event ``type_`` with ``fields``; ValueError for a type or field that is not declared."""
    cls = KINDS.get(type_)
    if cls is None:
        raise ValueError(f"unknown node event type {type_!r}: declare it in meshllm/events.py")
    try:
        return cls(**fields)
    except TypeError as exc:
        raise ValueError(f"node event {type_!r}: {exc}") from None


def from_wire(data: Mapping[str, Any]) -> NodeEvent:
    """The typed event of one ``/api/events`` or JSON-log object; :class:`Unrecognised` for a type (or
    a field) this version does not know, so a newer node's events still show."""
    fields = {k: v for k, v in data.items() if k not in ("type", "ts")}
    ts = data.get("ts")
    ts = ts if isinstance(ts, int | float) and not isinstance(ts, bool) else 0.0
    kind = str(data.get("type", "?"))
    cls = KINDS.get(kind)
    if cls is not None:
        try:
            return cls(ts=ts, **fields)
        except TypeError:
            pass
    return Unrecognised(ts=ts, kind=kind, fields=fields)


def events_module_js() -> str:
    """The console's ``events.js``: which event types make it reload what (from :data:`KINDS`)."""
    def names(flag: str) -> str:
        return json.dumps([name for name, cls in KINDS.items() if getattr(cls, flag)])
    return ("// Generated by meshllm/events.py from the node's event types; do not edit.\n"
            f"export const REFRESH_ON = new Set({names('refreshes')});\n"
            f"export const BOARD_ON = new Set({names('board')});\n"
            f"export const NOISY = new Set({names('live_only')});\n")


class EventHub:
    """Fan-out of node events to subscribers and a short history."""

    def __init__(self, history: int = 100, queue_size: int = 256) -> None:
        self._history: collections.deque[NodeEvent] = collections.deque(maxlen=history)
        self._queues: set[asyncio.Queue[NodeEvent]] = set()
        self._queue_size = queue_size
        self._sinks: list[Callable[[NodeEvent], None]] = []

    def add_sink(self, sink: Callable[[NodeEvent], None]) -> None:
        """Call ``sink(event)`` synchronously for every event (used for logging)."""
        self._sinks.append(sink)

    def publish(self, type_: str | NodeEvent, **fields: Any) -> NodeEvent:
        """Record an event and hand it to every reader: a typed event, or its wire ``type`` and fields
        (the callback form the parts below the hub report through; ValueError for an undeclared one)."""
        event = type_ if isinstance(type_, NodeEvent) else typed_event(type_, **fields)
        if not event.live_only:
            self._history.append(event)
        for sink in self._sinks:
            sink(event)
        for queue in self._queues:
            if queue.full():
                queue.get_nowait()
            queue.put_nowait(event)
        return event

    def recent(self) -> list[NodeEvent]:
        """The last events, oldest first."""
        return list(self._history)

    def subscribe(self) -> Subscription:
        """Events published from this call on.

        The subscription is in place when this returns, so ``subscribe()`` then :meth:`recent` in the
        same step of the event loop gives a history and a live stream with nothing lost between them.
        """
        return Subscription(self._queues, self._queue_size)


class Subscription:
    """One reader's queue of live events; :meth:`aclose` unsubscribes."""

    def __init__(self, queues: set[asyncio.Queue[NodeEvent]], size: int) -> None:
        self._queues = queues
        self._queue: asyncio.Queue[NodeEvent] = asyncio.Queue(size)
        queues.add(self._queue)

    def __aiter__(self) -> Subscription:
        return self

    async def __anext__(self) -> NodeEvent:
        if self._queue not in self._queues:
            raise StopAsyncIteration
        return await self._queue.get()

    async def aclose(self) -> None:
        """Stop receiving events."""
        self._queues.discard(self._queue)
