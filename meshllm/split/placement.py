"""Placement in the mesh: plan a chain from gossip, have workers host their ranges, replan on failure.

The pure part turns what gossip knows (peer records: role, capacity, addresses; the RTT matrix) into
the planner's inputs and a plan into hops and JSON. :class:`SplitPlacement` is the node-side driver
for one split model: it plans, asks each worker over ``stage-control`` to host its range (naming the
model by id, with this node's signed manifest of the file: a worker without the file fetches just
its range's tensors from this node and other holders), loads the first range itself, and attaches a
:class:`SplitCoordinator` to the model's :class:`SplitEngine`. When a request reports a failed stage,
the engine is detached at once (new requests get a 503 that says a replan is running), the node is
kept out of plans for a while, and a new chain is placed over the nodes that are left.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import Awaitable, Callable, Collection, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from meshllm.engine.ggml import StageModel
from meshllm.engine.ggml.hparams import read_hparams
from meshllm.engine.ggml.memory import memory_profile
from meshllm.engine.kernels import Kernels
from meshllm.engine.speculate import SpeculateMode
from meshllm.errors import MeshllmError
from meshllm.mesh.records import Capacity, PeerRecord
from meshllm.models.gguf_file import GGUFFile
from meshllm.models.refs import ModelRef
from meshllm.split.audit import AUDIT_MEMORY, AUDIT_RATE
from meshllm.split.control import Host, Hosted, Release, Unwarm, Warm, Warmed, ask
from meshllm.split.coordinator import DEFAULT_BATCH, SplitCoordinator
from meshllm.split.coordinator_core import Deadlines
from meshllm.split.engine import NO_CHAIN, SplitEngine
from meshllm.split.errors import SplitError, StageFailed
from meshllm.split.frames import Hop
from meshllm.split.planner import Candidate, Held, ModelProfile, Plan, PlanOptions, plan, plan_held
from meshllm.split.stage import StageServer
from meshllm.tasks import Scope

log = logging.getLogger(__name__)

SplitMode = Literal["auto", "force", "off"]


@dataclass
class FetchProgress:
    """How far one stage of a chain being placed is with fetching its layers (``/api/status`` ``splits``)."""

    bytes_done: int = 0
    bytes_total: int = 0
    started: float = dataclasses.field(default_factory=time.monotonic)
    updated: float = dataclasses.field(default_factory=time.monotonic)

    def update(self, done: int, total: int) -> None:
        self.bytes_done, self.bytes_total, self.updated = done, total, time.monotonic()

    def json(self) -> dict[str, Any]:
        elapsed = self.updated - self.started
        rate = self.bytes_done / elapsed if elapsed > 0 else 0.0
        left = max(0, self.bytes_total - self.bytes_done)
        return {"bytes_done": self.bytes_done, "bytes_total": self.bytes_total, "rate_bytes_s": round(rate),
                "eta_s": round(left / rate, 1) if rate > 0 and left else (0.0 if self.bytes_total and not left
                                                                          else None)}
RAM_SHARE = 0.75
"""Share of a node's RAM offered to models when ``--max-memory`` is not given."""
SUSPECT_S = 30.0
"""How long a node whose stage failed stays out of plans (gossip drops a dead one well before)."""
UNTRUSTED_S = 24 * 3600.0
"""How long a node an audit caught forging stays out of this node's plans (at most for the process)."""
RETRY_S = 1.0
"""Pause between placement attempts while no chain fits (workers missing, a host refused)."""
WATCH_S = 0.05
"""How often a placement waiting for workers looks at the membership."""
SPARE_CHECK_S = 2.0
"""How often a serving chain's warm spares are re-planned (workers come and go)."""
SPARE_SLACK = 2
"""Layers a warm range reaches beyond the planned one on each side: the replan after a death may see a
slightly different RTT matrix than the spare check did, and a stage file must cover the whole range to be
used. (A replan priced with the speeds the chain measured can move a boundary further; it then falls back
to the best chain inside what the nodes hold: :func:`~meshllm.split.planner.plan_held`.)"""


@dataclass(frozen=True)
class SplitOptions:
    """``meshllm serve --split MODE [--stages N] [--max-memory GB]``."""

    mode: SplitMode = "off"
    stages: int | None = None
    """Force exactly this many stages (fewer after a failure if not enough workers are left)."""
    max_memory: int | None = None
    """Bytes of RAM this node gives its own stage and whole models (``--max-memory``; a worker's
    caps what it offers). Never another node's cap: each worker declares its own in its record."""
    context: int = 4096
    """Tokens of KV each stage reserves per session (priced into every layer)."""
    threads: int | None = None
    """CPU threads of each stage this node loads (``--threads``)."""
    gpu_layers: int | None = None
    """Layers of each stage this node loads that go to its accelerator (``--gpu-layers``; None: all that fit)."""
    kernels: Kernels = "exact"
    """The node's ggml kernel choice (``--kernels``), the same for its stages as for its whole models."""
    speculate: SpeculateMode = "auto"
    """Speculative decoding on the chains this node coordinates (``--speculate``)."""
    audit_rate: float = AUDIT_RATE
    """Share of split requests the coordinator audits by recomputation (``--split-audit``; 0: none)."""
    audit_memory: int = AUDIT_MEMORY
    """Bytes an audit's loaded layers may hold at once (``--split-audit-memory``)."""
    batch: int = DEFAULT_BATCH
    """Requests whose decode steps go down a chain this node coordinates as one pass (``--split-batch``)."""
    spares: bool = True
    """Keep warm spares for the chains this node coordinates (``--split-spares``)."""

    def load_stage(self, path: Path, layer_start: int, layer_end: int, max_context: int) -> StageModel:
        """Load a layer range with this node's threads and accelerator settings (blocking)."""
        return StageModel.load(path, layer_start, layer_end, max_context=max_context, threads=self.threads,
                               gpu_layers=self.gpu_layers, kernels=self.kernels)


class NotEnoughWorkers(SplitError):
    """Fewer live workers than the forced stage count needs."""

    hint = "start workers with `meshllm join TOKEN --worker`"


def offered_ram(ram_bytes: int, max_memory: int | None) -> int:
    """RAM a node gives models: its ``--max-memory``, else :data:`RAM_SHARE` of its ``ram_bytes``."""
    return max_memory if max_memory is not None else int(ram_bytes * RAM_SHARE)


def memory_budget(capacity: Capacity, max_memory: int | None) -> int:
    """Bytes a node offers to models: ``max_memory`` (else a share of its RAM) plus its accelerator's free memory.

    A stage puts the layers that fit on the accelerator (``--gpu-layers``) and the rest in RAM, so
    both count; ``--max-memory`` caps the RAM part.
    """
    return offered_ram(capacity.ram_bytes, max_memory) + capacity.vram_bytes


def offered_memory(capacity: Capacity) -> int:
    """Bytes a worker offers to stages, from its record's capacity (``service.offered_capacity``): what a
    coordinator's planner assumes of it, and what its own :class:`~meshllm.split.control.StageHost` accepts."""
    return capacity.ram_bytes + capacity.vram_bytes


def node_budget(own: PeerRecord, max_memory: int | None) -> int:
    """Memory this node gives its own stages and whole models: a worker's is exactly what its record offers
    (:func:`offered_memory`, the number every coordinator plans with); any other node's is its
    :func:`memory_budget` (``max_memory`` is then its own cap, a worker's is already in its record)."""
    if own.role == "worker":
        return offered_memory(own.capacity)
    return memory_budget(own.capacity, max_memory)


def model_profile(path: Path, context: int) -> ModelProfile:
    """Per-layer and end costs of the GGUF at ``path`` (header only: milliseconds).

    Bytes are what the ggml runtime holds (stored tensor bytes, f16 KV for ``context`` tokens or
    the model's own context if shorter, compute buffers per stage); layers are priced at the
    largest layer so that a plan never counts on a layer being smaller than it is.
    """
    reader = GGUFFile(path)
    hp = read_hparams(reader)
    # a split never holds more than the model's context, and its stages get the lane's prompt chunks
    mem = memory_profile(reader, hp, min(context, hp.context_length), Deadlines().prefill_chunk)
    return ModelProfile(
        n_layers=hp.n_layers, layer_bytes=max(mem.layer_bytes) + mem.kv_bytes_per_layer,
        first_bytes=mem.embed_bytes, last_bytes=mem.head_bytes + mem.logits_bytes,
        layer_flops=2.0 * max(mem.layer_params), head_flops=2.0 * mem.head_params,
        stage_bytes=mem.compute_bytes + mem.rope_bytes + mem.input_bytes[1],  # (a hybrid's kept inputs)
        shared_bytes=mem.embed_bytes if mem.tied else 0,
    )


def budget_source(role: str, max_memory: int | None) -> str:
    """Where a candidate's memory comes from, for ``/api/plan`` (``nodes[].memory``)."""
    if role == "worker":
        return f"offered by the worker (its --max-memory, else {RAM_SHARE:.0%} of its RAM) plus its free VRAM"
    if max_memory is not None:
        return f"this node's --max-memory ({max_memory / 2**30:.2f} GiB) plus its free VRAM"
    return f"{RAM_SHARE:.0%} of this node's RAM plus its free VRAM"


def candidates(own: PeerRecord, own_budget: int, members: Mapping[str, PeerRecord],
               exclude: Collection[str] = (), measured: Mapping[str, float] | None = None) -> list[Candidate]:
    """This node (the coordinator) plus every live worker that can be dialled directly.

    Hosts serve whole models and clients nothing, so only workers offer stage memory; a worker with
    no listen address is reachable only through a relay and is never a stage. Each node's memory is
    its own: ``own_budget`` for this one, what its record offers for a worker (which its own
    ``--max-memory`` sets: :func:`offered_memory`, which its stage host enforces too). ``measured`` gives
    seconds per block that running chains of the same model measured (:func:`measured_speeds`);
    they replace the gossiped gflops estimate for those nodes.
    """
    speeds = measured or {}
    out = [Candidate(own.node_id, own_budget, gflops=own.capacity.gflops, role="host",
                     seconds_per_layer=speeds.get(own.node_id))]
    for node_id, rec in sorted(members.items()):
        if rec.role != "worker" or node_id in exclude or rec.state != "alive":
            continue
        out.append(Candidate(node_id, offered_memory(rec.capacity),
                             gflops=rec.capacity.gflops, role="worker",
                             relay_only=not rec.addresses.listen, seconds_per_layer=speeds.get(node_id)))
    return out


def measured_speeds(coordinator: SplitCoordinator, profile: ModelProfile) -> dict[str, float]:
    """Seconds per block of each node of a running chain, from the compute its stages report.

    The last stage's time includes the head, which the planner prices as ``head_flops /
    layer_flops`` blocks on the same node, so it is divided by its layers plus that many.
    """
    head_blocks = profile.head_flops / profile.layer_flops if profile.layer_flops > 0 else 0.0
    out = {}
    for i, (hop, seconds) in enumerate(zip(coordinator.chain, coordinator.stage_seconds(), strict=True)):
        if seconds is not None:
            blocks = hop.layer_end - hop.layer_start + (head_blocks if i == len(coordinator.chain) - 1 else 0.0)
            out[hop.node_id] = seconds / blocks
    return out


def hops(chosen: Plan, own: PeerRecord, members: Mapping[str, PeerRecord]) -> list[Hop]:
    """The plan as lane hops (node id, ``host:port``, range)."""
    records = {**members, own.node_id: own}
    return [Hop(s.node_id, records[s.node_id].addresses.listen[0], s.layer_start, s.layer_end)
            for s in chosen.stages]


def describe(chosen: Plan, names: Mapping[str, str], model: str, profile: ModelProfile,
             measured: Collection[str] = (), acceptance: float | None = None,
             nodes: Collection[Candidate] = (), max_memory: int | None = None) -> dict[str, Any]:
    """JSON of a plan for ``/api/plan`` and ``meshllm plan``: chain, memory per stage, prediction.

    ``compute`` of a stage is ``measured`` when its node's speed comes from a running chain, else
    ``estimated`` (gossiped gflops); ``speculation`` appears when the plan was priced with an
    ``acceptance`` a running chain measured. ``nodes`` (the candidates planned over) adds what was
    assumed of each: its memory budget and where it comes from (``max_memory``: this node's cap).
    """
    predicted: dict[str, Any] = {"total": round(chosen.total_s * 1e3, 3), "compute": round(chosen.compute_s * 1e3, 3),
                                 "network": round(chosen.network_s * 1e3, 3),
                                 "overhead": round(chosen.overhead_s * 1e3, 3), "serve": round(chosen.serve_s * 1e3, 3)}
    if chosen.speculative_s is not None and acceptance is not None:
        predicted["speculation"] = {"acceptance": round(acceptance, 3), "window": chosen.window,
                                    "tokens_per_pass": round(chosen.tokens_per_pass, 3),
                                    "total": round(chosen.speculative_s * 1e3, 3)}
    return {
        "model": model, "n_layers": profile.n_layers, "solo": chosen.solo,
        "stages": [{"node_id": s.node_id, "name": names.get(s.node_id, s.node_id[:8]),
                    "layers": [s.layer_start, s.layer_end], "memory_bytes": s.memory_bytes,
                    "compute_ms": round(s.compute_s * 1e3, 3),
                    "compute": "measured" if s.node_id in measured else "estimated"} for s in chosen.stages],
        "predicted_ms_per_token": predicted,
        **({"nodes": [{"node_id": c.node_id, "name": names.get(c.node_id, c.node_id[:8]), "role": c.role,
                       "memory_bytes": c.memory_bytes, "memory": budget_source(c.role, max_memory)}
                      for c in nodes]} if nodes else {}),
    }


def spare_ranges(profile: ModelProfile, nodes: list[Candidate], rtt: Mapping[str, Mapping[str, float]],
                 chain: list[Hop], options: SplitOptions) -> dict[str, tuple[int, int]]:
    """The layers each worker should keep on disk so that the chain rebuilt after any one worker's death
    needs no transfer: for each worker of ``chain``, the degraded plan without it; every node that
    plan gives layers it does not hold now gets them (a node's ranges over all deaths merged into one,
    widened by :data:`SPARE_SLACK` layers each way). Deaths that leave no chain are skipped.
    """
    holds = {h.node_id: (h.layer_start, h.layer_end) for h in chain}
    wanted: dict[str, tuple[int, int]] = {}
    for dead in chain[1:]:
        rest = [c for c in nodes if c.node_id != dead.node_id]
        try:
            degraded = plan(profile, rest, rtt, chain[0].node_id,
                            plan_options(options, len(rest) - 1, placing=True, degraded=True))
        except MeshllmError:
            continue
        for stage in degraded.stages[1:]:
            held = holds.get(stage.node_id)
            if held is not None and held[0] <= stage.layer_start and stage.layer_end <= held[1]:
                continue
            low, high = wanted.get(stage.node_id, (stage.layer_start, stage.layer_end))
            wanted[stage.node_id] = (min(low, stage.layer_start), max(high, stage.layer_end))
    return {node: (max(1, low - SPARE_SLACK), min(profile.n_layers, high + SPARE_SLACK))
            for node, (low, high) in wanted.items()}


def choose_plan(profile: ModelProfile, nodes: list[Candidate], rtt: Mapping[str, Mapping[str, float]],
                requester: str, held: Held, opts: PlanOptions) -> Plan:
    """The chain a placement builds: the cheapest one inside what the nodes keep on disk (``held``: stages
    they hosted, warm spares) whenever one fits, else the free plan.

    A chain that serves now beats a better balanced one that waits for bytes. The free plan of a rebuild
    is priced with the speeds the old chain measured and the RTT matrix of the moment, so it can order
    the survivors or place the boundaries unlike the plan the spares were warmed for (:func:`spare_ranges`
    runs on gossiped speeds, seconds earlier): taking it first and the held one only as a fallback left
    the spares' ranges in about 2 runs of 5 of tests/node/test_failover_split.py.
    """
    chosen = plan_held(profile, nodes, rtt, requester, held, opts) if held else None
    return chosen if chosen is not None else plan(profile, nodes, rtt, requester, opts)


def covered_deaths(profile: ModelProfile, nodes: list[Candidate], rtt: Mapping[str, Mapping[str, float]],
                   chain: list[Hop], options: SplitOptions, held: Held) -> list[str]:
    """The workers of ``chain`` whose death leaves a chain that forms with no transfer: the replan
    without them (:func:`plan_held` over ``nodes`` less the dead one, at the stage count a replan
    asks for) fits inside what the nodes keep on disk (``held``). What ``split_spares_ready``
    reports as ``covered``: a rebuild after such a death fetches nothing, whatever speeds it is priced with."""
    out = []
    for dead in chain[1:]:
        rest = [c for c in nodes if c.node_id != dead.node_id]
        try:
            opts = plan_options(options, len(rest) - 1, placing=True, degraded=True)
        except MeshllmError:
            continue
        if plan_held(profile, rest, rtt, chain[0].node_id, held, opts) is not None:
            out.append(dead.node_id)
    return out


def plan_options(options: SplitOptions, workers: int, *, placing: bool = False, degraded: bool = False) -> PlanOptions:
    """Planner options for the mode: ``--stages`` fixes the stage count. (``--max-memory`` is not one:
    it is this node's budget, in its :class:`Candidate`; each worker's is the one its record offers.)

    ``placing`` (a chain is to be built now) needs a worker per extra stage; ``degraded`` (a replan
    after a failure) accepts fewer stages, down to two, rather than serving nothing.
    """
    if options.mode == "force" or options.stages:
        want = options.stages or 1 + workers
        if placing and workers < 1:
            raise NotEnoughWorkers("a split needs at least one live worker; none is in the mesh")
        if placing and workers < want - 1:
            if not degraded:
                raise NotEnoughWorkers(f"waiting for workers: {want} stages need {want - 1}, the mesh has {workers}")
            want = 1 + workers
        return PlanOptions(stages=max(2, want) if placing else want)
    return PlanOptions()


class SplitPlacement:
    """Keeps one split model served by a live chain: place, watch for a failed stage, replan."""

    def __init__(self, *, own: Callable[[], PeerRecord], members: Callable[[], dict[str, PeerRecord]],
                 rtt: Callable[[], dict[str, dict[str, float]]], server: StageServer, engine: SplitEngine,
                 ref: ModelRef, manifest: bytes, options: SplitOptions, budget: int,
                 publish: Callable[..., Any], on_chain: Callable[[list[Hop] | None], None],
                 profile: ModelProfile | None = None,
                 audits: Callable[[], dict[str, object]] | None = None,
                 hub_source: Callable[[int, int, Callable[[int, int], None]], Awaitable[bytes]] | None = None
                 ) -> None:
        """``manifest``: the model's manifest signed by this node, sent with every stage request;
        ``audits()``: the model's audit counters for ``/api/status``; ``hub_source(start, end,
        progress)``, for a model taken straight from the hub: fetch this node's own layers (telling
        ``progress(done, total)`` on the loop), and return the signed ``HubSource`` sent to workers
        in place of the manifest."""
        self._own, self._members, self._rtt = own, members, rtt
        self.server = server
        self.engine = engine
        self.ref = ref
        self.manifest = manifest
        self.options = options
        self.budget = budget
        self.publish = publish
        self.on_chain = on_chain
        self.profile = profile or model_profile(ref.path, options.context)
        self.chain: list[Hop] = []
        self.placing: list[Hop] = []
        """The chain being placed now (its stages fetching and loading their layers)."""
        self.fetching: dict[str, FetchProgress] = {}
        """Node id -> its stage's fetch in the latest placement (kept once done: what it took)."""
        self.plan: Plan | None = None
        self.coordinator: SplitCoordinator | None = None
        """The latest chain's coordinator (kept after a failure: its measured stage speeds inform the replan)."""
        self._first: StageModel | None = None
        self._suspects: dict[str, float] = {}
        self.untrusted: dict[str, float] = {}
        """Nodes an audit caught (node id -> until when, monotonic): never placed on again before then."""
        self._audits = audits
        self.hosted: dict[str, tuple[int, int]] = {}
        """Node id -> the layer range it hosts for this model now (its stage file pinned there). A worker
        holds one stage per coordinator and model: a new range replaces the old one, whose file it unpins,
        and a released range leaves; either counts on only as a warm range the node keeps (``_kept``)."""
        self._asked: dict[str, tuple[int, int]] = {}
        """Node id -> the warm range it was last asked to keep. Kept across chains: a node the next
        chain's spares no longer want is told to drop it (``Unwarm``)."""
        self._kept: dict[str, list[Any]] = {}
        """Node id -> ``[name, layer_start, layer_end, fetched_bytes]`` of the warm range it confirmed
        keeping (``Warmed``, and every refresh since)."""
        self._refused: dict[str, str] = {}
        """Node id -> why it did not keep its warm range (refused, or the file was evicted)."""
        self.hub_source = hub_source
        self._replan = asyncio.Event()
        self._scope = Scope(f"split placement {self.engine.model_id}")
        """The placement loop and the releases it sends."""
        self._spares = Scope(f"split spares {self.engine.model_id}")
        """The serving chain's spare keeping (replaced with the chain)."""
        self.spares: list[list[Any]] = []
        """The serving chain's warm spares: ``[name, layer_start, layer_end, fetched_bytes]`` each."""
        self.covered: list[str] = []
        """The serving chain's workers whose death leaves a chain that needs no transfer (:func:`covered_deaths`)."""

    @property
    def held(self) -> dict[str, set[tuple[int, int]]]:
        """Node id -> the layer ranges it keeps on disk for this model: the stage it hosts (pinned) and the
        warm range it confirmed keeping (weakly pinned, refreshed every spare check). Nothing else: a file a
        worker unpinned (a released or replaced stage) may be evicted by its library at any time."""
        out = {node: {layers} for node, layers in self.hosted.items()}
        for node, (_name, start, end, _fetched) in self._kept.items():
            out.setdefault(node, set()).add((start, end))
        return out

    def start(self, prepared: Awaitable[bytes] | None = None) -> None:
        """Place and keep a chain; first await ``prepared`` (the engine's tokenizer and the signed manifest,
        which replaces the one given at construction when not empty)."""
        self._scope.spawn(self._run(prepared))

    async def stop(self) -> None:
        await self._scope.aclose()  # (the loop first: it is what starts spares)
        await self._spares.aclose()
        self.engine.detach("stopped")
        if self._first is not None:
            await asyncio.to_thread(self._first.close)
            self._first = None

    def status(self) -> dict[str, Any]:
        """The ``/api/status`` ``splits`` entry: the chain with names and ranges, and its state."""
        names = self.names()
        ready = self.engine.coordinator is not None
        chain = self.chain if ready or not self.placing else self.placing
        return {
            "model": self.engine.model_id,
            "state": "ready" if ready else "placing",
            "reason": None if ready else self.engine.unavailable,
            "stages": [{"node_id": h.node_id, "name": names.get(h.node_id, h.node_id[:8]),
                        "layers": [h.layer_start, h.layer_end],
                        "fetch": self.fetching[h.node_id].json() if h.node_id in self.fetching else None}
                       for h in chain],
            "predicted_ms_per_token": round(self.plan.total_s * 1e3, 3) if self.plan else None,
            "replays": self.engine.replays,
            "replays_failed": self.engine.replays_failed,
            "speculation": coordinator.speculation_status() if (coordinator := self.engine.coordinator) else None,
            "audits": self._audits() if self._audits is not None else None,
            "untrusted": sorted(self.untrusted),
            "batching": coordinator.batching_status() if coordinator is not None else None,
            "spares": [{"name": name, "layers": [start, end]} for name, start, end, _ in self.spares],
            "covered": [names.get(n, n[:8]) for n in self.covered],
        }

    def names(self) -> dict[str, str]:
        own = self._own()
        return {**{n: r.name for n, r in self._members().items()}, own.node_id: own.name}

    def stage_failed(self, exc: StageFailed) -> None:
        """A request saw ``exc``: stop taking requests on this chain and replan without that node."""
        self._suspects[exc.node_id] = time.monotonic() + SUSPECT_S
        if self.engine.coordinator is not None:
            self.engine.detach(f"stage {exc.stage_index} on node {exc.node_id[:12]} failed; replanning the chain")
            self.publish("split_stage_failed", model=self.engine.model_id, stage=exc.stage_index,
                         failed_node=exc.node_id, reason=exc.reason)
        self._replan.set()

    def evict(self, coordinator: SplitCoordinator, nodes: Collection[str], reason: str) -> None:
        """An audit of ``coordinator``'s chain caught ``nodes``: never place on them again, replan now.

        Their stages are released (best effort: a forger may ignore it), and the chain is torn down
        only if it is still the one serving (a later chain already excludes them).
        """
        until = time.monotonic() + UNTRUSTED_S
        for node in nodes:
            self.untrusted[node] = until
        if self.engine.coordinator is coordinator:
            self.engine.detach(f"an audit caught {len(nodes)} stage(s) of the chain forging output; replanning")
            self._replan.set()
        for hop in coordinator.chain:
            if hop.node_id in nodes:
                self._release(hop)

    def _release(self, hop: Hop) -> None:
        """Release ``hop``'s stage (sent in the background) and stop counting on its range at once: the worker
        unpins its file, so the library may evict it. (A warm range the node keeps still counts: ``held``.)"""
        self.hosted.pop(hop.node_id, None)
        self._scope.spawn(self._send_release(hop))

    async def _send_release(self, hop: Hop) -> None:
        with contextlib.suppress(MeshllmError):
            await ask(self.server.endpoint, hop.node_id, hop.addr, Release(model=self.engine.model_id), timeout=5.0)

    async def _run(self, prepared: Awaitable[bytes] | None) -> None:
        if prepared is not None:
            try:
                self.manifest = await prepared or self.manifest
            except Exception as exc:  # a tokenizer llama.cpp cannot load, an unreadable file: say so, serve none
                log.error("split %s cannot be served: %s", self.engine.model_id, exc)
                self.engine.detach(f"{NO_CHAIN}: {exc}")
                self.publish("split_waiting", model=self.engine.model_id, reason=str(exc))
                return
        while True:
            self._replan.clear()
            try:
                await self._place()
            except (MeshllmError, OSError) as exc:
                reason = f"{NO_CHAIN}: {exc}"
                if reason != self.engine.unavailable:
                    log.info("split %s: %s", self.engine.model_id, exc)
                    self.publish("split_waiting", model=self.engine.model_id, reason=str(exc))
                self.engine.detach(reason)
                await self._retry_wait()
                continue
            await self._replan.wait()

    async def _retry_wait(self) -> None:
        """Sleep :data:`RETRY_S` before placing again, or less once the live workers change (one that just
        joined may complete the chain: placing it at once saves up to a second of time to serve)."""
        def workers() -> set[str]:
            return {n for n, r in self._members().items() if r.role == "worker" and r.state == "alive"}
        before, deadline = workers(), time.monotonic() + RETRY_S
        while time.monotonic() < deadline and workers() == before:
            await asyncio.sleep(WATCH_S)

    async def _place(self) -> None:
        started = time.monotonic()
        now = time.monotonic()
        self._suspects = {n: t for n, t in self._suspects.items() if t > now}
        self.untrusted = {n: t for n, t in self.untrusted.items() if t > now}
        own, members = self._own(), self._members()
        old = self.coordinator
        measured = measured_speeds(old, self.profile) if old is not None else {}
        nodes = candidates(own, self.budget, members, {*self._suspects, *self.untrusted}, measured)
        opts = plan_options(self.options, len(nodes) - 1, placing=True, degraded=self.plan is not None)
        chosen = choose_plan(self.profile, nodes, self._rtt(), own.node_id, self.held, opts)
        if chosen.solo or chosen.stages[0].node_id != own.node_id:
            raise SplitError("the plan does not start at this node with at least one worker")
        chain = hops(chosen, own, members)
        first = chain[0]
        self.placing, self.fetching = chain, {}
        hub = b""
        if self.hub_source is not None:
            hub = await self.hub_source(first.layer_start, first.layer_end, self._progress(first.node_id).update)
        # Every hop's answer is in before this placement succeeds or fails: a hop still fetching when another
        # failed would otherwise run on unheld beside the next placement, which asks that worker for the same
        # range again (and two fetches were reported for one transfer).
        outcomes = await asyncio.gather(*(self._host(chain, i, hub) for i in range(1, len(chain))),
                                        self._load_first(first), return_exceptions=True)
        for outcome in outcomes:
            if isinstance(outcome, BaseException):
                raise outcome
        assert self._first is not None
        coordinator = SplitCoordinator(self.server, self.engine.model_id, self._first, chain,
                                       on_stage_failed=self.stage_failed, speculate=self.options.speculate,
                                       batch=self.options.batch)
        self.chain, self.plan, self.coordinator, self.placing = chain, chosen, coordinator, []
        self.engine.attach(coordinator)
        self.on_chain(chain)
        names = self.names()
        self.publish("split_ready", model=self.engine.model_id,
                     stages=[[names.get(h.node_id, h.node_id[:8]), h.layer_start, h.layer_end] for h in chain],
                     predicted_ms=round(chosen.total_s * 1e3, 3), took_s=round(time.monotonic() - started, 3))
        self._spares.close()  # an older chain's spares are planned for deaths that no longer apply
        self._spares = Scope(f"split spares {self.engine.model_id}")
        self.spares, self.covered = [], []
        for node in self._refused:  # the new chain asks again those that did not keep their range
            self._asked.pop(node, None)
        self._refused.clear()
        if self.hub_source is None and self.options.spares:  # a hub model has no manifest a spare fetches against
            self._spares.spawn(self._keep_spares(chain))

    async def _host(self, chain: list[Hop], index: int, hub: bytes = b"") -> None:
        assert self.ref.sha256 is not None
        hop = chain[index]
        hosted = await ask(self.server.endpoint, hop.node_id, hop.addr, Host(
            model=self.engine.model_id, model_id=self.ref.sha256, manifest=b"" if hub else self.manifest, hub=hub,
            chain=chain, index=index, max_context=self.engine.max_context,
        ), on_progress=lambda p: self._progress(hop.node_id).update(p.bytes_done, p.bytes_total))
        self.hosted[hop.node_id] = (hop.layer_start, hop.layer_end)  # replaces (and unpins) its earlier range
        if isinstance(hosted, Hosted) and hosted.fetched_bytes:
            self._progress(hop.node_id).update(hosted.fetched_bytes, hosted.fetched_bytes)  # what it took
            self.publish("split_stage_fetched", model=self.engine.model_id, node=hop.node_id,
                         layers=[hop.layer_start, hop.layer_end], bytes=hosted.fetched_bytes,
                         bad_holders=hosted.bad_holders)

    async def _keep_spares(self, chain: list[Hop]) -> None:
        """While ``chain`` serves, keep its warm spares (:func:`spare_ranges`) on the nodes' disks: checked
        every :data:`SPARE_CHECK_S`, so a worker that joins later becomes a spare too. Each check also
        asks every spare again for the range it keeps (a refresh: nothing moves while its file is there)
        and stops counting on one whose library had to evict it; a node no longer wanted is told to drop
        its range. Each change is published as ``split_spares_ready`` (what each spare holds, and who
        refused)."""
        assert self.ref.sha256 is not None
        asked, kept, refused = self._asked, self._kept, self._refused
        first = True
        while True:
            # after each check, the first too: a new chain serves its first requests before spares load the host
            await asyncio.sleep(SPARE_CHECK_S)
            own, members = self._own(), self._members()
            nodes = candidates(own, self.budget, members, {*self._suspects, *self.untrusted})
            wanted = spare_ranges(self.profile, nodes, self._rtt(), chain, self.options)
            reachable = {n for n in members if members[n].addresses.listen}
            todo = {n: r for n, r in wanted.items() if asked.get(n) != r and n in reachable}
            check = {n: asked[n] for n in kept if n in wanted and n not in todo and n in reachable}
            gone = {*kept, *refused, *asked} - set(wanted)  # no longer a spare (it left, or the plan moved on)
            changed = bool(todo or gone) or first
            for node in gone:
                kept.pop(node, None)
                refused.pop(node, None)
                if asked.pop(node, None) is not None and node in reachable:
                    self._spares.spawn(self._unwarm(members[node].addresses.listen[0], node))
            names = self.names()
            jobs = {node: self._warm(members[node].addresses.listen[0], own.addresses.listen[0], node, a, b,
                                     refresh=node not in todo) for node, (a, b) in {**check, **todo}.items()}
            for node, outcome in zip(jobs, await asyncio.gather(*jobs.values()), strict=True):
                if isinstance(outcome, str):  # refused, or (a refresh) its file was evicted: not held any more
                    changed = changed or node in kept
                    kept.pop(node, None)
                    refused[node] = outcome
                elif node in todo:
                    refused.pop(node, None)
                    kept[node] = [names.get(node, node[:8]), *todo[node], outcome]
            asked.update(todo)
            covered = covered_deaths(self.profile, nodes, self._rtt(), chain, self.options, self.held)
            if changed or covered != self.covered:
                self.spares, self.covered = list(kept.values()), covered
                self.publish("split_spares_ready", model=self.engine.model_id, spares=self.spares,
                             failed=[[names.get(n, n[:8]), why] for n, why in refused.items()],
                             chain=[h.node_id for h in chain],
                             covered=[names.get(n, n[:8]) for n in self.covered])
                first = False

    async def _warm(self, addr: str, own_addr: str, node: str, start: int, end: int, *,
                    refresh: bool = False) -> int | str:
        """Ask ``node`` to keep layers ``[start, end)`` on disk (``refresh``: whether it still does, without
        the manifest): the bytes it fetched, or why it does not."""
        assert self.ref.sha256 is not None
        try:
            warmed = await ask(self.server.endpoint, node, addr, Warm(
                model=self.engine.model_id, model_id=self.ref.sha256, manifest=b"" if refresh else self.manifest,
                layer_start=start, layer_end=end, addr=own_addr))
        except MeshllmError as exc:
            return str(exc)
        return warmed.fetched_bytes if isinstance(warmed, Warmed) else 0

    async def _unwarm(self, addr: str, node: str) -> None:
        """Tell ``node`` it need not keep its warm range (best effort: its library may evict the file)."""
        with contextlib.suppress(MeshllmError):
            await ask(self.server.endpoint, node, addr, Unwarm(model=self.engine.model_id), timeout=5.0)

    def _progress(self, node_id: str) -> FetchProgress:
        return self.fetching.setdefault(node_id, FetchProgress())

    async def _load_first(self, hop: Hop) -> None:
        held = self._first
        if held is None or (held.layer_start, held.layer_end) != (hop.layer_start, hop.layer_end):
            self._first = await asyncio.to_thread(
                self.options.load_stage, self.ref.path, hop.layer_start, hop.layer_end, self.engine.max_context
            )
            if held is not None:  # the old chain is detached; free its first stage
                await asyncio.to_thread(held.close)


def needs_split(options: SplitOptions, profile: ModelProfile, budget: int) -> bool:
    """``force`` always splits; ``auto`` only when the whole model does not fit this node's budget."""
    if options.mode == "off":
        return False
    if options.mode == "force":
        return True
    return profile.whole_bytes > budget
