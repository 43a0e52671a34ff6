"""Stage control: a coordinator asks a worker to host a layer range (stream kind ``stage-control``).

One short stream per request: ``Host`` -> ``Progress``* -> ``Hosted`` or ``Refused``; ``Release`` ->
``Released`` or ``Refused``; ``Warm`` -> ``Progress``* -> ``Warmed`` or ``Refused`` (layers kept on disk
for a rebuild, see :class:`Warm`; the same ``Warm`` again checks they still are); ``Unwarm`` ->
``Released`` or ``Refused``. A model is named by its id (the sha256 of its file), never by a path:
``Host`` carries the coordinator's **manifest** of the file, signed with its node key, and the worker
finds the layers in its own library (the whole file, or a stage file it kept) or fetches just that
range's tensors from the coordinator and every other holder, checking each piece against the
manifest (``models/store.py``). ``Progress`` frames keep the request alive while bytes travel.

**Authority.** A stage belongs to the coordinator that placed it, and only that coordinator (the
peer on the control stream, whose TLS identity the transport proved) may host, re-place or release
it: ``Host`` is accepted only when its chain starts at the requester and names this node, and the
manifest must be signed by the requester; ``Release`` releases only the requester's own stage. The
chain in ``Host`` is recorded with the stage, and the stage server opens sessions only for exactly
that chain (``split/stage.py``). Per member, a worker hosts at most :data:`MAX_STAGES_PER_MEMBER`
stages within its memory budget, and never evicts one member's stage for another.

Only a node started with ``--worker`` answers (:class:`StageHost`); any other refuses at the stream.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, TypeVar

import msgspec
from msgspec import Meta

from meshllm.engine.ggml import StageModel
from meshllm.engine.ggml.hparams import read_hparams
from meshllm.engine.ggml.memory import compute_bytes, session_bytes
from meshllm.engine.ggml.weights import plan_stage
from meshllm.errors import DecodeError, MeshllmError
from meshllm.identity.ids import short
from meshllm.models.gguf_file import GGUFFile
from meshllm.models.hub_stage import fetch_stage, open_source
from meshllm.models.library import LibraryEntry
from meshllm.models.manifest import MAX_MANIFEST, MODEL_ID, open_manifest
from meshllm.models.store import ModelStore
from meshllm.net import Endpoint, NetError, PeerConnection, Stream
from meshllm.split.coordinator_core import Deadlines
from meshllm.split.errors import SplitError
from meshllm.split.frames import Hop
from meshllm.split.stage import StageServer
from meshllm.wire.addr import parse_addr

log = logging.getLogger(__name__)
T = TypeVar("T")

KIND = "stage-control"
REPLY_TIMEOUT_S = 60.0
"""Longest silence on a control stream: the worker sends Progress at least every :data:`PROGRESS_S`."""
PROGRESS_S = 2.0
MAX_STAGES_PER_MEMBER = 4
"""Stages one coordinator may keep on one worker (a model each)."""
CONTROL_FRAME = MAX_MANIFEST + 64 * 1024

ModelName = Annotated[str, Meta(min_length=1, max_length=200)]


class Host(msgspec.Struct, frozen=True, kw_only=True, tag="host"):
    """Host ``chain[index]``'s layers of the model ``model_id`` (served as ``model``) for this chain."""

    model: ModelName
    model_id: Annotated[str, Meta(pattern=MODEL_ID.pattern)]
    chain: Annotated[list[Hop], Meta(min_length=2, max_length=64)]
    index: Annotated[int, Meta(ge=1, le=63)]
    max_context: Annotated[int, Meta(ge=1, le=1 << 24)]
    manifest: Annotated[bytes, Meta(max_length=MAX_MANIFEST)] = b""
    """The model's manifest, signed by the coordinator (``chain[0]``); empty when ``hub`` is given."""
    hub: Annotated[bytes, Meta(max_length=MAX_MANIFEST)] = b""
    """For a model the coordinator takes straight from the hub: its signed ``HubSource``
    (``models/hub_stage.py``); the worker fetches its range from the hub too."""

    @property
    def hop(self) -> Hop:
        return self.chain[self.index]


class Warm(msgspec.Struct, frozen=True, kw_only=True, tag="warm"):
    """Keep layers ``[layer_start, layer_end)`` of the model on disk, unloaded: a warm spare.

    A rebuilt chain that gives this node other layers after another stage's death then loads them from
    its disk instead of fetching them. Any member may ask (it is the coordinator of a chain this node
    may be placed on), for at most :data:`MAX_STAGES_PER_MEMBER` models; the bytes come from it (at
    ``addr``, dialled as the requester's node id) and other holders, checked against its signed
    manifest, into an ordinary stage file of the library, weakly pinned there while warm (evicted only
    when nothing else makes room in the disk budget). The same request again (same model and layers;
    its manifest may then be empty) is a **refresh**: ``Warmed`` with nothing fetched while the file is
    still there, ``Refused`` once the library had to evict it (the coordinator then stops counting on
    it). A new range replaces the old.
    """

    model: ModelName
    model_id: Annotated[str, Meta(pattern=MODEL_ID.pattern)]
    manifest: Annotated[bytes, Meta(max_length=MAX_MANIFEST)]
    """The model's manifest, signed by the coordinator (empty for a refresh: nothing is fetched)."""
    layer_start: Annotated[int, Meta(ge=0, lt=1 << 16)]
    layer_end: Annotated[int, Meta(ge=1, le=1 << 16)]
    addr: Annotated[str, Meta(max_length=300)]
    """The requester's mesh address (``host:port``), where the bytes are fetched from."""


class Release(msgspec.Struct, frozen=True, kw_only=True, tag="release"):
    """Stop serving the requester's stage of ``model`` (a replan moved its layers elsewhere)."""

    model: ModelName


class Unwarm(msgspec.Struct, frozen=True, kw_only=True, tag="unwarm"):
    """Stop keeping the requester's warm range of ``model`` (its file is left to the library's eviction)."""

    model: ModelName


class Progress(msgspec.Struct, frozen=True, kw_only=True, tag="progress"):
    """The worker is still fetching (or loading) the range."""

    bytes_done: int
    bytes_total: int


class Hosted(msgspec.Struct, frozen=True, kw_only=True, tag="hosted"):
    model: str
    layer_start: int
    layer_end: int
    fetched_bytes: int = 0
    """Bytes the worker fetched from peers to host the range (0 when it had them)."""
    bad_holders: list[str] = []
    """Holders dropped from that transfer for sending bytes that did not match the manifest; for a
    stage from the hub, the sources named for a piece that disagreed (``hub <host>`` or a node)."""


class Released(msgspec.Struct, frozen=True, kw_only=True, tag="released"):
    model: str


class Warmed(msgspec.Struct, frozen=True, kw_only=True, tag="warmed"):
    model: str
    layer_start: int
    layer_end: int
    fetched_bytes: int = 0
    """Bytes fetched from peers for it (0 when the node already had them)."""


class Refused(msgspec.Struct, frozen=True, kw_only=True, tag="refused"):
    message: str


Request = Host | Release | Warm | Unwarm
Reply = Progress | Hosted | Released | Warmed | Refused


class HostRefused(SplitError):
    """A worker would not (or could not) host the range it was asked for."""

    hint = "see the worker's log; `meshllm models list` on it shows what it holds"


@dataclass
class HostedStage:
    """A stage this worker holds for one coordinator."""

    owner: str
    request: Host
    memory: int
    """Bytes the runtime is estimated to hold for it (what the worker's budget counts)."""
    entry: LibraryEntry
    """The library file it was loaded from (pinned: never evicted while hosted)."""

    @property
    def layers(self) -> tuple[int, int]:
        return self.request.hop.layer_start, self.request.hop.layer_end


@dataclass
class WarmRange:
    """Layers this worker keeps on disk for one coordinator (:class:`Warm`)."""

    model_id: str
    layers: tuple[int, int]
    entry: LibraryEntry | None = None
    """The library file holding them, weakly pinned; None while it is being fetched."""


Loader = Callable[[Path, int, int, int], StageModel]


class _LiveNames(Mapping[str, str]):
    """Peer names looked up when a transfer reports, not when it starts: a coordinator can send Host
    before its own record has reached this worker, and its name should show once it has."""

    def __init__(self, names: Callable[[], dict[str, str]]) -> None:
        self._names = names

    def __getitem__(self, node_id: str) -> str:
        return self._names()[node_id]

    def __iter__(self) -> Iterator[str]:
        return iter(self._names())

    def __len__(self) -> int:
        return len(self._names())


class StageHost:
    """Worker side: answers ``stage-control`` streams by loading ranges into the node's :class:`StageServer`.

    ``on_change(model)`` tells the node that what it hosts changed, for its peer record. ``budget``
    (bytes) caps what the stages of all members together may hold.
    """

    def __init__(self, server: StageServer, store: ModelStore, budget: int,
                 on_change: Callable[[str], None] | None = None, load: Loader | None = None,
                 names: Callable[[], dict[str, str]] | None = None,
                 is_owner: Callable[[str], bool] | None = None) -> None:
        """``is_owner(node_id)``: whether that peer is the mesh owner's node (which may release any stage)."""
        self.server = server
        self.store = store
        self.budget = budget
        self.on_change = on_change
        self.load = load or (lambda path, a, b, ctx: StageModel.load(path, a, b, max_context=ctx))
        """``load(path, layer_start, layer_end, max_context)``: the node's stage loader (threads, GPU layers)."""
        self.names = names or dict
        self.is_owner = is_owner or (lambda _node: False)
        self.hosted: dict[tuple[str, str], HostedStage] = {}
        """(owner node id, model) -> what is hosted for that coordinator."""
        self.warm: dict[tuple[str, str], WarmRange] = {}
        """(coordinator node id, model) -> the layers kept on disk for it (:class:`Warm`)."""
        server.endpoint.on_stream(KIND, self._serve, max_frame=CONTROL_FRAME)

    async def _serve(self, stream: Stream, peer: PeerConnection) -> None:
        peer_id = peer.node_id or ""
        request = await stream.recv(Request, timeout=5.0)
        if request is None:
            return
        refresh = isinstance(request, Warm) and self._warm_held(peer_id, request) is not None
        try:
            reply: Reply = await self._handle(stream, peer_id, request)
        except (MeshllmError, OSError) as exc:
            reply = Refused(message=str(exc))
        level = logging.DEBUG if refresh and isinstance(reply, Warmed) else logging.INFO  # a check every 2 s
        log.log(level, "stage-control from %s: %s -> %s", short(peer_id), type(request).__name__, type(reply).__name__)
        await stream.send(reply)

    async def _handle(self, stream: Stream, peer_id: str, request: Request) -> Reply:
        if isinstance(request, Release):
            keys = [(peer_id, request.model)] if (peer_id, request.model) in self.hosted else []
            if not keys and self.is_owner(peer_id):  # the mesh owner may release any member's stage of it
                keys = [k for k in self.hosted if k[1] == request.model]
            if not keys:
                return Refused(message=f"no stage of {request.model} is hosted here for node {short(peer_id)}")
            for owner, model in keys:
                held = self.hosted.pop((owner, model))
                self.server.unhost(model, owner=owner)
                self.store.library.unpin(held.entry)
            self._changed(request.model)
            return Released(model=request.model)
        if isinstance(request, Unwarm):
            if (peer_id, request.model) not in self.warm:
                return Refused(message=f"no warm range of {request.model} is kept here for node {short(peer_id)}")
            self._drop_warm((peer_id, request.model))
            return Released(model=request.model)
        if isinstance(request, Warm):
            return await self._warm(stream, peer_id, request)
        return await self._host(stream, peer_id, request)

    def _warm_held(self, peer_id: str, request: Warm) -> WarmRange | None:
        """The warm range ``request`` asks for again (a refresh), if this node keeps exactly it."""
        held = self.warm.get((peer_id, request.model))
        if held is None or held.entry is None or held.model_id != request.model_id:
            return None
        return held if held.layers == (request.layer_start, request.layer_end) else None

    def _drop_warm(self, key: tuple[str, str]) -> None:
        """Stop keeping ``key``'s warm range: its file is unpinned unless another warm range uses it."""
        held = self.warm.pop(key, None)
        if held is not None and held.entry is not None:
            self._unpin_warm(held.entry)

    def _unpin_warm(self, entry: LibraryEntry) -> None:
        if not any(w.entry is not None and w.entry.key == entry.key for w in self.warm.values()):
            self.store.library.unpin(entry, weak=True)

    def _refresh(self, key: tuple[str, str], held: WarmRange, request: Warm) -> Reply:
        """A coordinator checks that its warm range is still on disk (the library may have had to evict it)."""
        start, end = held.layers
        library = self.store.library
        found = library.whole(held.model_id) or library.stage(held.model_id, start, end)
        if found is None:
            self._drop_warm(key)
            return Refused(message=f"the warm layers [{start}, {end}) of {request.model} were evicted from this "
                                   "node's disk (its model library's disk budget is full)")
        if held.entry is not None and found.key != held.entry.key:  # another file holds them now: keep that one
            library.pin(found, weak=True)
            old, held.entry = held.entry, found
            self._unpin_warm(old)
        return Warmed(model=request.model, layer_start=start, layer_end=end)

    async def _warm(self, stream: Stream, peer_id: str, request: Warm) -> Reply:
        """Fetch (or find) a warm range onto disk for a coordinator (:class:`Warm`), or check it (a refresh)."""
        key = (peer_id, request.model)
        held = self._warm_held(peer_id, request)
        if held is not None:
            return self._refresh(key, held, request)
        if not request.manifest:
            return Refused(message=f"layers [{request.layer_start}, {request.layer_end}) of {request.model} are "
                                   "not kept warm here (a new warm range needs the model's manifest)")
        mine = [k for k in self.warm if k[0] == peer_id and k != key]
        if len(mine) >= MAX_STAGES_PER_MEMBER:
            return Refused(message=f"node {short(peer_id)} already has {len(mine)} warm ranges here "
                                   f"(at most {MAX_STAGES_PER_MEMBER} per member)")
        start, end = request.layer_start, request.layer_end
        if end <= start:
            return Refused(message=f"empty layer range [{start}, {end})")
        try:
            parse_addr(request.addr)
        except DecodeError:
            return Refused(message=f"not a host:port address: {request.addr!r}")
        manifest = open_manifest(request.manifest, peer_id, request.model_id)

        def check(header: GGUFFile) -> None:
            if end > (layers := read_hparams(header).n_layers):
                raise HostRefused(f"layers [{start}, {end}) run past the model's {layers}")

        library = self.store.library
        had = library.whole(manifest.model) or library.stage(manifest.model, start, end)
        transfer = f"{manifest.model}:{start}-{end}"
        before = self.warm.get(key)  # a range it kept before (the plan moved): kept until the new one is in
        pending = self.warm[key] = WarmRange(manifest.model, (start, end))  # counted while it fetches: the quota
        try:
            entry = await self._keep_alive(stream, asyncio.ensure_future(self.store.stage_file(
                manifest, request.model, start, end, [(peer_id, request.addr)], None, check)), transfer)
        except BaseException:
            if self.warm.get(key) is pending:
                if before is not None:
                    self.warm[key] = before
                else:
                    del self.warm[key]
            raise
        library.pin(entry, weak=True)
        pending.entry = entry
        if self.warm.get(key) is not pending:  # a later request for the key replaced this one meanwhile
            self._unpin_warm(entry)
        elif before is not None and before.entry is not None:
            self._unpin_warm(before.entry)
        view = self.store.transfers.get(transfer) if had is None else None
        return Warmed(model=request.model, layer_start=start, layer_end=end,
                      fetched_bytes=view.bytes_done if view is not None else 0)

    async def _host(self, stream: Stream, peer_id: str, request: Host) -> Reply:
        why = self._check_request(peer_id, request)
        if why:
            return Refused(message=why)
        if not request.hub and not request.manifest:
            return Refused(message="a stage request needs a manifest or a hub source")
        start, end = request.hop.layer_start, request.hop.layer_end
        key = (peer_id, request.model)
        held = self.hosted.get(key)
        if held is not None and held.request.model_id == request.model_id and held.layers == (start, end):
            self.hosted[key] = HostedStage(peer_id, request, held.memory, held.entry)  # same layers, new chain
            self.server.place(request.model, owner=peer_id, chain=request.chain)
            return Hosted(model=request.model, layer_start=start, layer_end=end)
        others = sum(h.memory for k, h in self.hosted.items() if k != key)
        mine = [k for k in self.hosted if k[0] == peer_id and k != key]
        if len(mine) >= MAX_STAGES_PER_MEMBER:
            return Refused(message=f"node {short(peer_id)} already has {len(mine)} stages here "
                                   f"(at most {MAX_STAGES_PER_MEMBER} per member)")
        memory: list[int] = []

        def check(header: GGUFFile) -> None:
            need = stage_memory(header, start, end, request.max_context)
            if others + need > self.budget:
                raise HostRefused(f"layers [{start}, {end}) need {need / 2**20:.0f} MiB; this worker has "
                                  f"{max(0, self.budget - others) / 2**20:.0f} MiB free for stages")
            memory.append(need)

        names = _LiveNames(self.names)
        transfer = f"{request.model_id}:{start}-{end}"
        library = self.store.library
        if request.hub:
            source = open_source(request.hub, peer_id, request.model_id)
            got = await self._keep_alive(stream, asyncio.ensure_future(fetch_stage(
                self.store, source, request.model, start, end, coordinator=peer_id, check=check)), transfer)
            entry, fetched = got.entry, got.fetched
            bad = sorted({d.bad for d in got.disagreements or []})
        else:
            manifest = open_manifest(request.manifest, peer_id, request.model_id)
            had = library.whole(manifest.model) or library.stage(manifest.model, start, end)
            entry = await self._keep_alive(stream, asyncio.ensure_future(self.store.stage_file(
                manifest, request.model, start, end, [(peer_id, request.chain[0].addr)], names, check)), transfer)
            view = self.store.transfers.get(transfer) if had is None else None
            fetched = view.bytes_done if view is not None else 0
            bad = [h["node_id"] for h in view.holders.values() if h["bad"]] if view is not None else []
        stage = await self._keep_alive(stream, asyncio.ensure_future(
            asyncio.to_thread(self.load, entry.file, start, end, request.max_context)), None)
        library.pin(entry)
        self.server.host(request.model, stage, owner=peer_id, chain=request.chain)
        if held is not None and held.entry.key != entry.key:
            library.unpin(held.entry)
        self.hosted[key] = HostedStage(peer_id, request, memory[0] if memory else 0, entry)
        self._changed(request.model)
        return Hosted(model=request.model, layer_start=start, layer_end=end, fetched_bytes=fetched, bad_holders=bad)

    def _check_request(self, peer_id: str, request: Host) -> str | None:
        """Why ``request`` is refused before anything is fetched, or None."""
        chain = request.chain
        if chain[0].node_id != peer_id:
            return "a stage request must come from the coordinator its chain starts with"
        if request.index >= len(chain) or request.hop.node_id != self.server.endpoint.node_id:
            return "the chain does not place this node where the request says"
        if chain[0].layer_start != 0 or any(a.layer_end != b.layer_start for a, b in itertools.pairwise(chain)):
            return "the chain's layer ranges are not contiguous from layer 0"
        if any(h.layer_end <= h.layer_start for h in chain) or len({h.node_id for h in chain}) != len(chain):
            return "the chain has an empty stage or a node twice"
        return None

    async def _keep_alive(self, stream: Stream, task: asyncio.Future[T], transfer: str | None) -> T:
        """Await ``task``, sending Progress every :data:`PROGRESS_S` so the coordinator keeps waiting."""
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=PROGRESS_S)
                if done:
                    return task.result()
                view = self.store.transfers.get(transfer) if transfer else None
                await stream.send(Progress(bytes_done=view.bytes_done if view else 0,
                                           bytes_total=view.bytes_total if view else 0))
        except NetError:
            task.cancel()
            raise

    def _changed(self, model: str) -> None:
        if self.on_change is not None:
            self.on_change(model)


def stage_memory(reader: GGUFFile, start: int, end: int, context: int) -> int:
    """Bytes layers ``[start, end)`` will hold: their tensors, one session's KV at ``context``, compute buffers.

    Works from the model's header or from a stage file (which holds only its range), unlike the
    planner's whole-model profile.
    """
    hp = read_hparams(reader)
    plan = plan_stage(reader, hp, start, end)
    kv = session_bytes(hp, start, end, min(context, hp.context_length), first=start == 0)
    logits = hp.vocab * 4 if end == hp.n_layers else 0
    return plan.nbytes + kv + compute_bytes(hp, min(context, hp.context_length), Deadlines().prefill_chunk) + logits


async def ask(endpoint: Endpoint, node_id: str, addr: str, request: Request,
              timeout: float = REPLY_TIMEOUT_S,
              on_progress: Callable[[Progress], None] | None = None) -> Hosted | Released | Warmed:
    """Send one control request to ``node_id`` at ``addr``; :class:`HostRefused` unless it succeeds.

    ``timeout`` bounds each silence: a worker fetching a range sends Progress while it works
    (``on_progress`` sees each).
    """
    try:
        conn = await endpoint.connect(parse_addr(addr), node_id, timeout=3.0)
        stream = await conn.open_stream(KIND, max_frame=CONTROL_FRAME)
        await stream.send(request)
        while isinstance(reply := await stream.recv(Reply, timeout=timeout), Progress):
            if on_progress is not None:
                on_progress(reply)
    except (NetError, OSError, DecodeError) as exc:
        raise HostRefused(f"node {short(node_id)} did not answer the stage request: {exc}") from None
    if reply is None or isinstance(reply, Refused):
        why = reply.message if reply is not None else "stream ended (is it a --worker?)"
        raise HostRefused(f"node {short(node_id)} refused: {why}")
    return reply
