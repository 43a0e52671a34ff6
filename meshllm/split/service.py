"""A node's split side: its stage server, worker duties, split models, and what it tells the mesh.

Every node runs a :class:`StageServer` (coordinators receive their Tokens on it too). A worker also
answers ``stage-control`` (:class:`StageHost`), finding or fetching the layers it is asked for through
the node's :class:`~meshllm.models.store.ModelStore`. A host started with ``--split auto|force`` keeps each
model that must (or is forced to) be split out of the ordinary engines, serves it through a
:class:`SplitEngine` and keeps a chain placed for it (:class:`SplitPlacement`). What each node holds
goes into its peer record: the coordinator announces the model with ``engine="split"`` and its own
range (routable: it serves the whole model), a worker each hosted range with ``engine="stage"``
(not routable: a stage alone answers nothing).
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec
from nacl.signing import SigningKey

from meshllm.errors import MeshllmError
from meshllm.events import EventHub
from meshllm.mesh.records import Capacity, Models, PeerRecord, ServedModel
from meshllm.mesh.service import MeshService
from meshllm.models.hub import cached, is_hub_ref, parse_hub_ref
from meshllm.models.hub_stage import HubModel, sign_source
from meshllm.models.manifest import sign_manifest
from meshllm.models.refs import ModelRef, resolve_model
from meshllm.models.store import ModelStore
from meshllm.runtime.serving import Serving
from meshllm.split.audit import Recorder
from meshllm.split.auditor import Auditor, serve_records
from meshllm.split.control import StageHost
from meshllm.split.engine import SplitEngine
from meshllm.split.frames import Hop
from meshllm.split.placement import (
    SplitOptions,
    SplitPlacement,
    candidates,
    describe,
    measured_speeds,
    memory_budget,
    model_profile,
    needs_split,
    node_budget,
    offered_ram,
    plan_options,
)
from meshllm.split.planner import ModelProfile, Speculation, plan
from meshllm.split.stage import StageServer
from meshllm.split.tcp_lane import LaneDialer, TcpStream

SPLIT_ENGINE = "split"
"""``ServedModel.engine`` of a coordinator: serves the whole model through its chain (routable)."""
STAGE_ENGINE = "stage"
"""``ServedModel.engine`` of a worker's hosted range (never a routing target)."""


async def _prepared(engine: SplitEngine, manifest: asyncio.Future[bytes] | None) -> bytes:
    """Load ``engine``'s tokenizer, then the signed manifest placement sends workers (empty: a hub model)."""
    await engine.load()
    return await manifest if manifest is not None else b""


def offered_capacity(capacity: Capacity, role: str, max_memory: int | None) -> Capacity:
    """The capacity a node's peer record carries. A worker's RAM is what it offers to stages: its
    ``--max-memory`` (never more than it measured), else ``RAM_SHARE`` of its RAM (:func:`offered_ram`).
    So the memory coordinators plan with (:func:`~meshllm.split.placement.offered_memory`) is the budget
    its stage host enforces (:func:`~meshllm.split.placement.node_budget`). Other records stay as measured."""
    if role != "worker":
        return capacity
    ram = offered_ram(capacity.ram_bytes, max_memory)
    if max_memory is not None and capacity.ram_bytes:
        ram = min(ram, capacity.ram_bytes)
    return msgspec.structs.replace(capacity, ram_bytes=ram)



class SplitService:
    """Stage server, worker host and split placements of one node."""

    def __init__(self, mesh: MeshService, serving: Serving, events: EventHub, role: str,
                 options: SplitOptions, store: ModelStore, signing_key: SigningKey) -> None:
        assert mesh.endpoint is not None and mesh.gossip is not None
        self.mesh = mesh
        self.serving = serving
        self.events = events
        self.options = options
        self.store = store
        self.key = signing_key
        traffic = mesh.endpoint.traffic
        dial = LaneDialer(signing_key, store.bulk_ports, traffic) if store.bulk_ports is not None else None
        self.server = StageServer(mesh.endpoint, dial=dial)
        store.bulk_server.on_lane = lambda reader, writer, peer: self.server.serve_lane(
            TcpStream(reader, writer, traffic=traffic), peer)
        self.host = StageHost(self.server, store, self.budget, self._hosted_changed, options.load_stage,
                              names=self._names, is_owner=self._is_mesh_owner) if role == "worker" else None
        if role == "worker":  # keep what our stages compute, so a coordinator's audit can say who lied
            self.server.recorder = Recorder()
            serve_records(mesh.endpoint, self.server.recorder, signing_key)
        self.auditor = Auditor(mesh.endpoint, rate=options.audit_rate, memory=options.audit_memory,
                               kernels=options.kernels, publish=events.publish)
        self.placements: dict[str, SplitPlacement] = {}
        self._pending: list[tuple[ModelRef, ModelProfile, asyncio.Future[bytes] | None, HubModel | None]] = []
        self._chains: dict[str, list[Hop]] = {}

    def _own(self) -> PeerRecord:
        assert self.mesh.gossip is not None
        return self.mesh.gossip.own

    def _members(self) -> dict[str, PeerRecord]:
        assert self.mesh.gossip is not None
        return self.mesh.gossip.members()

    def _is_mesh_owner(self, node_id: str) -> bool:
        """Whether ``node_id`` holds the mesh owner's membership (from its record, checked now)."""
        record = self._members().get(node_id)
        if record is None:
            return False
        try:
            standing = self.mesh.admission.standing(node_id, record.membership_proof, time.time())
        except MeshllmError:
            return False
        return standing.via == "owner"

    def _names(self) -> dict[str, str]:
        return {n: r.name for n, r in self._members().items()}

    def _rtt(self) -> dict[str, dict[str, float]]:
        assert self.mesh.gossip is not None
        return self.mesh.gossip.rtt_matrix()

    @property
    def budget(self) -> int:
        """Memory this node gives its own stages and whole models (a worker's: what its record offers)."""
        return node_budget(self._own(), self.options.max_memory)

    async def prepare(self, specs: list[str]) -> list[str]:
        """Take the models to split out of ``specs`` (hashing them); return the ones to load whole."""
        if self.options.mode == "off":
            return specs
        rest = []
        for spec in specs:
            hub = await self._from_hub(spec)
            ref = hub.ref if hub is not None else await self.serving.resolve(spec)
            profile = await asyncio.to_thread(model_profile, ref.path, self.options.context)
            if not needs_split(self.options, profile, self.budget):
                rest.append(spec)  # loaded whole (an hf: model is pulled whole then)
                if hub is not None:
                    await asyncio.to_thread(hub.discard)
            elif hub is not None:
                self._pending.append((ref, profile, None, hub))
            else:
                entry = await asyncio.to_thread(self.store.library.add, ref.path, source="file", owned=False,
                                                name=ref.model_id, model_id=ref.sha256)
                self.store.library.pin(entry)
                ref = dataclasses.replace(ref, sha256=entry.id)
                # the manifest hashes the whole file the first time (0.9 s for Gemma 3 270M here): it is
                # built while the node comes up and workers join, and placement waits for it
                manifest = asyncio.ensure_future(asyncio.to_thread(
                    lambda e=entry: sign_manifest(self.key, self.store.library.manifest(e))))
                self._pending.append((ref, profile, manifest, None))
        return rest

    async def _from_hub(self, spec: str) -> HubModel | None:
        """An ``hf:`` model not in the library yet, opened for hub-direct stages (its header fetched by range)."""
        if not is_hub_ref(spec) or cached(parse_hub_ref(spec), self.store.library) is not None:
            return None
        view = self.store.begin_view(spec, spec, spec, "hub-header", None)
        try:
            hub = await asyncio.to_thread(HubModel.open, spec, self.store.library)
        except (MeshllmError, OSError) as exc:
            self.store.end_view(view, error=str(exc))
            raise
        view.bytes_done = view.bytes_total = hub.fetched
        self.store.end_view(view, fetched=hub.fetched)
        self.events.publish("split_from_hub", model=hub.ref.model_id, id=hub.model_id, spec=hub.hub.spec,
                            size=hub.hub.size, header_bytes=len(hub.header), fetched=hub.fetched)
        return hub

    def _hub_source(self, hub: HubModel, model: str
                    ) -> Callable[[int, int, Callable[[int, int], None]], Awaitable[bytes]]:
        """Fetch this node's own layers of ``hub`` (progress in the status), then sign its source for workers."""
        async def source(start: int, end: int, progress: Callable[[int, int], None]) -> bytes:
            view = self.store.begin_view(f"{hub.model_id}:{start}-{end}", hub.model_id, model, "hub-stage",
                                         (start, end))
            loop = asyncio.get_running_loop()
            report = self.store.reporter(view)

            def both(done: int, total: int) -> None:
                report(done, total)
                loop.call_soon_threadsafe(progress, done, total)

            try:
                result = await asyncio.to_thread(hub.ensure, start, end, both)
            except (MeshllmError, OSError) as exc:
                self.store.end_view(view, error=str(exc))
                raise
            self.store.end_view(view, fetched=result.fetched)
            return sign_source(self.key, hub.source())
        return source

    async def start(self) -> None:
        """Register a :class:`SplitEngine` per split model and start placing its chain.

        Returns at once: each placement first loads its engine's tokenizer and waits for the model's
        manifest (seconds on a big file), so the node is ready (and its invite out) meanwhile; the
        model is listed once its chain forms, as always.
        """
        for ref, profile, manifest, hub in self._pending:
            engine = SplitEngine(ref.path, ref.model_id, self.options.context,
                                 max_replays=self.serving.backend.replay.max_replays, on_event=self.events.publish)
            self.serving.add_engine(engine, ref.path, ref.sha256)
            placement = SplitPlacement(
                own=self._own, members=self._members, rtt=self._rtt, server=self.server, engine=engine, ref=ref,
                manifest=b"", options=self.options, budget=self.budget, publish=self.events.publish,
                on_chain=lambda chain, model=ref.model_id: self._chain_changed(model, chain), profile=profile,
                audits=lambda model=ref.model_id: self.auditor.status(model),
                hub_source=self._hub_source(hub, ref.model_id) if hub is not None else None,
            )
            if hub is None:  # an audit recomputes every layer from this node's file: a hub model has only its own
                engine.on_finished = lambda coordinator, request, p=placement: self.auditor.submit(
                    p, coordinator, request)
            self.placements[ref.model_id] = placement
            self.events.publish("split_placing", model=ref.model_id, mode=self.options.mode,
                                stages=self.options.stages)
            placement.start(_prepared(engine, manifest))
        self._pending = []

    async def stop(self) -> None:
        for placement in self.placements.values():
            await placement.stop()
        await self.auditor.close()
        self.server.close()

    def status(self) -> list[dict[str, Any]]:
        """``/api/status`` ``splits``."""
        return [p.status() for p in self.placements.values()]

    def stages_status(self) -> list[dict[str, object]]:
        """``/api/status`` ``stages``: the layer ranges this node hosts for chains, with their open sessions."""
        return self.server.status()

    def plan_json(self, spec: str, stages: int | None, max_memory: int | None) -> dict[str, Any]:
        """What the planner would choose for ``spec`` over this node's view of the mesh (``/api/plan``)."""
        ref = resolve_model(spec, progress=False, library=self.store.library)
        profile = model_profile(ref.path, self.options.context)
        # ``max_memory`` asks "what if this node had that much": it is this node's budget, never a worker's
        cap = max_memory or self.options.max_memory
        options = SplitOptions(mode="force" if stages else "auto", stages=stages, context=self.options.context)
        own, members = self._own(), self._members()
        # a chain of this model that ran here measured its nodes' speeds and its acceptance: plan with them
        running = self.placements.get(ref.model_id)
        coordinator = running.coordinator if running is not None else None
        measured = measured_speeds(coordinator, profile) if coordinator is not None else {}
        acceptance = coordinator.acceptance.rate if coordinator is not None and coordinator.stats.drafted else None
        nodes = candidates(own, memory_budget(own.capacity, cap), members, measured=measured)
        opts = plan_options(options, len(nodes) - 1)
        if coordinator is not None and (serve := coordinator.serve_seconds) is not None:
            opts = dataclasses.replace(opts, serve_overhead_s=serve)
        if acceptance is not None:
            opts = dataclasses.replace(opts, speculation=Speculation(acceptance))
        chosen = plan(profile, nodes, self._rtt(), own.node_id, opts)
        names = {**{n: r.name for n, r in members.items()}, own.node_id: own.name}
        return describe(chosen, names, ref.model_id, profile, measured, acceptance, nodes=nodes, max_memory=cap)

    # -- the peer record -------------------------------------------------------------------------

    def _chain_changed(self, model: str, chain: list[Hop] | None) -> None:
        if chain:
            self._chains[model] = chain
        else:
            self._chains.pop(model, None)
        self._announce()

    def _hosted_changed(self, _model: str) -> None:
        self._announce()

    def _announce(self) -> None:
        """Replace our split and stage entries in ``models.served``, leaving other engines' entries alone."""
        own = self._own()
        served = [m for m in own.models.served if m.engine not in (SPLIT_ENGINE, STAGE_ENGINE)]
        for model, chain in self._chains.items():
            placement = self.placements[model]
            served.append(ServedModel(name=model, context=placement.engine.max_context,
                                      layer_start=chain[0].layer_start, layer_end=chain[0].layer_end,
                                      engine=SPLIT_ENGINE, id=placement.ref.sha256 or ""))
        for (_owner, model), held in (self.host.hosted.items() if self.host else ()):
            start, end = held.layers
            served.append(ServedModel(name=model, context=held.request.max_context, layer_start=start,
                                      layer_end=end, engine=STAGE_ENGINE, id=held.request.model_id))
        self.mesh.update_own(models=Models(served=served, available=own.models.available))
