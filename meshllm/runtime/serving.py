"""The node's serving side: the engines it runs, what it tells the mesh about them, and its backend.

Loading a model publishes it in the node's peer record (``models.served``) so peers can route to
it; a background task copies the engines' load into the record every few seconds, which the
routers of other nodes read. ``backend`` is what the HTTP routes call: a
:class:`~meshllm.runtime.mesh_backend.MeshBackend` over the live engine table, so it exists (and
routes to peers) before, while and after models load; a ``--client`` node has no engines and
only routes. Peers' requests arrive on ``"request"`` streams, served by
:class:`~meshllm.runtime.tunnel_serve.TunnelService` with the same engines.

``--model`` references resolve in one place (:func:`~meshllm.models.refs.resolve_model`): a path, a
name or id from the node's model library, or ``hf:...`` (downloaded into it); a name or id that is
neither here nor on the hub is fetched whole from a peer that offers it (``models/store.py``), so a
mesh downloads a model once, not once per machine. Every model the node loads joins its library, and
so its peer record's list of models peers may fetch.

Models come and go while the node serves (``meshllm models load|unload``, owner commands, standby):
:meth:`Serving.load_model` loads one and announces it; :meth:`Serving.unload_model` first takes it
out of the engine table and the peer record (no new request reaches it, here or from peers), waits
until the engine reports no request running or queued (up to a deadline), then frees it. The
engine's own load report is what a drain reads, so it works for every engine alike.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from meshllm.engine.base import DEFAULT_MAX_TOKENS, Engine
from meshllm.engine.capacity import compute_devices, release_freed_memory
from meshllm.engine.kernels import Kernels
from meshllm.engine.llama import LlamaEngine
from meshllm.engine.recommended import Recommended, for_model
from meshllm.engine.speculate import SpeculateMode
from meshllm.errors import ConfigError, MeshllmError
from meshllm.events import EventHub
from meshllm.mesh.records import Load, Models, ServedModel
from meshllm.mesh.service import MeshService
from meshllm.models.hub import is_hub_ref
from meshllm.models.refs import ModelNotFound, ModelRef, looks_like_path, resolve_model
from meshllm.models.store import ModelStore
from meshllm.runtime.counters import RequestCounters
from meshllm.runtime.mesh_backend import MeshBackend
from meshllm.runtime.metrics import NodeMetrics, NodeState, PeerState
from meshllm.runtime.replay import ReplayPolicy
from meshllm.runtime.tunnel import STREAM_KIND
from meshllm.runtime.tunnel_serve import PEER_SLOTS, Slots, TunnelService
from meshllm.tasks import spawn

log = logging.getLogger(__name__)

LOAD_PUBLISH_S = 2.0
DRAIN_POLL_S = 0.05
ENGINES = ("llama", "ggml")
MEMORY_HEADROOM = 1.1
"""A model needs about its file size in memory plus its KV cache and buffers: refuse to load one whose
file is larger than the free memory divided by this (llama.cpp would fail, or the system swap)."""


class ModelNotServed(MeshllmError):
    """An unload names a model this node does not serve (or serves as a split chain, which it cannot unload)."""


class Serving:
    """Engines of this node, the backend the API routes call, and the tunnel peers call."""

    def __init__(self, node_id: str, mesh: MeshService, events: EventHub, peer_slots: int = PEER_SLOTS,
                 store: ModelStore | None = None, hash_cache: Path | None = None,
                 replay: ReplayPolicy | None = None, model_defaults: Mapping[str, Recommended] | None = None) -> None:
        """``hash_cache``: JSON file remembering model sha256s (a replay only continues on the same file);
        ``replay``: how routed generations broken mid-answer are continued elsewhere; ``model_defaults``:
        ``config.toml``'s ``[models.NAME]`` sampling, for what requests leave out; ``peer_slots``: requests
        peers may run here at once (over it a peer's request is refused at once and fails over)."""
        self.node_id = node_id
        self.mesh = mesh
        self.events = events
        self.store = store
        """The node's models on disk (None: references are paths or ``default`` only)."""
        self.engines: dict[str, Engine] = {}
        self.model_defaults = dict(model_defaults or {})
        self.hashes: dict[str, str] = {}
        """sha256 of each engine's model file, by model id (filled in the background after loading)."""
        self.hash_cache = hash_cache
        self.counters = RequestCounters()
        assert mesh.endpoint is not None
        self.metrics = NodeMetrics(NodeState(engines=self.engines, peers=self._peer_states,
                                             traffic=mesh.endpoint.traffic, counters=self.counters))
        """The node's ``/metrics`` registry (requests observed by the backend, state read at scrape time)."""
        self.backend = MeshBackend(node_id, self.engines, mesh, counters=self.counters, on_event=events.publish,
                                   replay=replay or ReplayPolicy(), hashes=self.hashes, metrics=self.metrics)
        self.tunnel = TunnelService(self.engines, Slots(peer_slots), self.counters,
                                    self.hashes)
        mesh.endpoint.on_stream(STREAM_KIND, self.tunnel.handle)
        self._load_task: asyncio.Task[None] | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._last_load: Load | None = None
        self.loaded: dict[str, str] = {}
        """Model id -> engine name of the whole models this node loaded (split chains are the split
        service's): what unload may free."""
        self.draining: dict[str, Engine] = {}
        """Models being unloaded: out of the engine table, finishing their requests."""
        self._announced: set[str] = set()
        self._loading: dict[str, asyncio.Future[Engine]] = {}
        """Loads in progress by model id: a second load of the same model waits for the first."""
        self._engine = "llama"
        self._settings: tuple[Any, ...] = (None, None, None, DEFAULT_MAX_TOKENS, "exact", "auto")
        """``threads, gpu_layers, parallel, max_tokens_default, kernels, speculate`` of :meth:`load_models`:
        what later loads use."""

    async def load_models(self, specs: list[str], engine: str = "llama", threads: int | None = None,
                          gpu_layers: int | None = None, parallel: int | None = None,
                          max_tokens_default: int = DEFAULT_MAX_TOKENS, kernels: Kernels = "exact",
                          speculate: SpeculateMode = "auto") -> None:
        """Resolve and load each model, then announce them all in our record; later loads use the same settings.

        ``gpu_layers``: layers to offload to the accelerator (None: all that fit); ``parallel`` is the
        llama.cpp engine's slots per model (``None``: sized from memory); ``max_tokens_default``
        caps its requests that set no ``max_tokens``; ``kernels`` picks row-exact or fast ggml kernels (both engines);
        ``speculate`` is the llama.cpp engine's speculative decoding mode.
        """
        if engine not in ENGINES:
            raise ConfigError(f"unknown engine {engine!r}", hint=f"choose one of {', '.join(ENGINES)}")
        self._engine = engine
        self._settings = (threads, gpu_layers, parallel, max_tokens_default, kernels, speculate)
        for spec in specs:
            await self._start(await self.resolve(spec))
        self.announce()
        self._load_task = asyncio.create_task(self._publish_load(), name="publish-load")

    async def load_model(self, spec: str) -> tuple[Engine, bool]:
        """Load ``spec`` while serving and announce it; ``(engine, False)`` when it is served already.

        Raises :class:`ConfigError` when the model would not fit the free memory or is being unloaded,
        and the resolver's or engine's error when the reference or the file is bad.
        """
        ref = await self.resolve(spec)
        model_id = ref.model_id
        if model_id in self.loaded:
            return self.engines[model_id], False
        if model_id in self._loading:
            return await asyncio.shield(self._loading[model_id]), False
        if model_id in self.engines:
            raise ConfigError(f"{model_id} is served here as a split chain",
                              hint="split models are placed at start (--split)")
        if model_id in self.draining:
            raise ConfigError(f"{model_id} is being unloaded here", hint="load it again once that finished")
        check_fits(ref)
        loading = self._loading[model_id] = asyncio.get_running_loop().create_future()
        try:
            engine = await self._start(ref)
        except asyncio.CancelledError:
            loading.cancel()
            raise
        except Exception as exc:
            loading.set_exception(exc)
            loading.exception()  # retrieved here: a load nobody else waited for is not an unhandled error
            raise
        else:
            loading.set_result(engine)
        finally:
            del self._loading[model_id]
        self.announce()
        return engine, True

    async def unload_model(self, model_id: str, timeout_s: float) -> dict[str, Any]:
        """Stop serving ``model_id``: unannounce it, let its requests finish (up to ``timeout_s``), free it.

        Requests still running at the deadline are cancelled (their clients get an error). Returns
        ``{model, drained, cancelled, waited_s}``.
        """
        if model_id not in self.loaded:
            what = "as a split chain, which it cannot unload" if model_id in self.engines else \
                "yet (it is still loading)" if model_id in self._loading else ""
            raise ModelNotServed(f"this node does not serve {model_id!r} {what}".rstrip(),
                                 hint="`meshllm models --api URL` lists what each node serves")
        del self.loaded[model_id]
        engine = self.draining[model_id] = self.engines.pop(model_id)
        self.hashes.pop(model_id, None)
        self.announce()
        started = time.monotonic()
        self.events.publish("model_draining", model=model_id, in_flight=in_flight(engine), timeout_s=timeout_s)
        while in_flight(engine) and time.monotonic() - started < timeout_s:
            await asyncio.sleep(DRAIN_POLL_S)
        cancelled = in_flight(engine)
        drained = not cancelled
        with contextlib.suppress(Exception):
            await engine.close()
        await asyncio.to_thread(release_freed_memory)
        self.draining.pop(model_id, None)
        self._unpin(model_id)
        waited = round(time.monotonic() - started, 2)
        self.events.publish("model_unloaded", model=model_id, drained=drained, cancelled=cancelled, waited_s=waited)
        return {"model": model_id, "drained": drained, "cancelled": cancelled, "waited_s": waited}

    async def _start(self, ref: ModelRef) -> Engine:
        """Load one model with this node's engine settings and put it in the engine table."""
        engine = self._make_engine(self._engine, ref, *self._settings)
        engine.recommended = for_model(ref.path, ref.model_id, self.model_defaults)
        self.events.publish("model_loading", model=ref.model_id, path=str(ref.path), engine=self._engine,
                            size_bytes=ref.path.stat().st_size)
        started = time.monotonic()
        await engine.load()
        self.loaded[engine.model_id] = self._engine
        self.engines[engine.model_id] = engine
        self.events.publish("model_ready", model=engine.model_id, engine=self._engine,
                            context=engine.context_length, slots=engine.load_report().slots,
                            load_s=round(time.monotonic() - started, 2))
        if ref.sha256:
            self.hashes[engine.model_id] = ref.sha256
        # one pass over the file learns its sha256: the library's indexing when there is one
        work = self._index(ref) if self.store is not None else self._hash(ref, engine.model_id)
        spawn(self._tasks, work, name=f"hash-{ref.model_id}")
        return engine

    def announce(self) -> None:
        """Our record's ``models.served``: the models loaded here, beside the split service's own entries."""
        gossip = self.mesh.gossip
        assert gossip is not None
        own = gossip.own.models
        served = [m for m in own.served if m.name not in self._announced]
        served += [ServedModel(name=mid, context=self.engines[mid].context_length, engine=kind,
                               tools=self.engines[mid].native_tools)
                   for mid, kind in self.loaded.items()]
        self._announced = set(self.loaded)
        self.mesh.update_own(models=Models(served=served, available=own.available))

    async def resolve(self, spec: str) -> ModelRef:
        """The model a ``--model`` reference names, downloading or fetching it when needed."""
        report = self.store.hub_reporter(spec) if self.store is not None and is_hub_ref(spec) else None
        library = self.store.library if self.store is not None else None
        try:
            ref = await asyncio.to_thread(resolve_model, spec, library=library, report=report)
        except ModelNotFound as exc:
            if report is not None:
                self.store.download_ended(spec, str(exc))  # type: ignore[union-attr]
            if self.store is None or is_hub_ref(spec) or looks_like_path(spec):
                raise
            self.events.publish("model_fetching", model=spec, reason="not on this node; asking the mesh")
            entry = await self.store.fetch_from_mesh(spec)
            return ModelRef(path=entry.file, model_id=entry.name, sha256=entry.id)
        if report is not None:
            self.store.download_ended(spec)  # type: ignore[union-attr]
        return ref

    async def _index(self, ref: ModelRef) -> None:
        """Add a loaded model to the library (hashing it, off the loop) so peers may fetch it, and
        learn its sha256 for replays on the way."""
        assert self.store is not None
        try:
            entry = await asyncio.to_thread(self.store.library.add, ref.path, source="file", owned=False,
                                            name=ref.model_id, model_id=ref.sha256)
        except (OSError, MeshllmError) as exc:
            log.warning("could not add %s to the model library: %s", ref.path, exc)
            return
        if ref.model_id in self.engines:
            self.hashes[ref.model_id] = entry.id
            self.store.library.pin(entry)  # in use: never evicted or removed while served
        self.store.changed()

    def _unpin(self, model_id: str) -> None:
        """An unloaded model's library entry may be evicted or removed again."""
        if self.store is not None:
            for entry in self.store.library.entries():
                if entry.name == model_id:
                    self.store.library.unpin(entry)

    def add_engine(self, engine: Engine, path: Path, sha256: str | None = None) -> None:
        """Serve an engine built elsewhere (a split model's chain, of the file at ``path``) as a local model;
        its owner announces it."""
        engine.recommended = for_model(path, engine.model_id, self.model_defaults)
        self.engines[engine.model_id] = engine
        if sha256:
            self.hashes[engine.model_id] = sha256

    async def _hash(self, ref: ModelRef, model_id: str) -> None:
        """Learn the model file's sha256 (without a library) off the loop: a big file takes seconds."""
        try:
            digest = (await asyncio.to_thread(ref.hashed, self.hash_cache)).sha256
        except OSError as exc:
            log.warning("cannot hash %s (replays of its requests take any file of that name): %s", ref.path, exc)
            return
        if digest and model_id in self.engines:
            self.hashes[model_id] = digest

    @staticmethod
    def _make_engine(engine: str, ref: Any, threads: int | None, gpu_layers: int | None, parallel: int | None,
                     max_tokens_default: int, kernels: Kernels, speculate: SpeculateMode) -> Engine:
        """``gpu_layers``: layers to offload to the accelerator (None: all that fit; 0 on CPU-only nodes)."""
        if engine == "ggml":
            from meshllm.engine.ggml.engine import GgmlEngine

            return GgmlEngine(ref.path, model_id=ref.model_id, threads=threads, gpu_layers=gpu_layers, kernels=kernels)
        from meshllm.engine.capacity import accelerator, llama_gpu_layers

        return LlamaEngine(ref, n_threads=threads, n_gpu_layers=llama_gpu_layers(ref.path, gpu_layers, accelerator()),
                           parallel=parallel, default_max_tokens=max_tokens_default, kernels=kernels,
                           speculate=speculate)

    async def _publish_load(self) -> None:
        """Copy the engines' load into our record when it changes (gossip spreads it)."""
        while True:
            reports = [e.load_report() for e in [*self.engines.values(), *self.draining.values()]]
            load = Load(in_flight=sum(r.running for r in reports), queue=sum(r.queued for r in reports),
                        tok_s=round(sum(r.tokens_per_s for r in reports), 1), slots=sum(r.slots for r in reports),
                        free_slots=sum(max(0, r.slots - r.running) for r in reports))
            if load != self._last_load:
                self._last_load = load
                self.mesh.update_own(load=load)
            await asyncio.sleep(LOAD_PUBLISH_S)

    def _peer_states(self) -> list[PeerState]:
        """Every peer gossip knows, its state and the RTT this node measured (its record's when not connected)."""
        gossip, endpoint = self.mesh.gossip, self.mesh.endpoint
        if gossip is None or endpoint is None:
            return []
        peers = []
        for node_id, entry in gossip.state.peers.items():
            conn = endpoint.peers.get(node_id)
            rtt = conn.rtt_ms if conn is not None else None
            if rtt is None and node_id in gossip.own.rtt:
                rtt = gossip.own.rtt[node_id].rtt_ms
            peers.append(PeerState(node_id, entry.record.name, entry.status, rtt))
        return peers

    def request_counters(self) -> dict[str, Any]:
        """The ``requests`` object of ``/api/status``: totals and requests in the last minute."""
        return self.counters.snapshot(time.time())

    async def close(self) -> None:
        if self._load_task is not None:
            self._load_task.cancel()
        for engine in [*self.engines.values(), *self.draining.values()]:
            with contextlib.suppress(Exception):
                await engine.close()


def in_flight(engine: Engine) -> int:
    """Requests running or waiting on ``engine`` (what an unload waits for)."""
    report = engine.load_report()
    return report.running + report.queued


def free_memory() -> int:
    """Bytes a new model could use now: the system's available RAM (ggml reports the CPU's total) plus
    the accelerators' free memory; 0 when unknown."""
    devices = compute_devices()
    ram = next((d.memory_free for d in devices if d.kind == "cpu"), 0)
    with contextlib.suppress(OSError, ValueError, StopIteration), open("/proc/meminfo") as fh:
        line = next(line for line in fh if line.startswith("MemAvailable:"))
        ram = int(line.split()[1]) * 1024
    return ram + sum(d.memory_free for d in devices if d.kind != "cpu")


def check_fits(ref: ModelRef) -> None:
    """Refuse (:class:`ConfigError`) a model whose file would not fit the memory free now (RAM and accelerators)."""
    free = free_memory()
    size = ref.path.stat().st_size
    if free and size * MEMORY_HEADROOM > free:
        raise ConfigError(f"{ref.model_id} ({size / 2**30:.1f} GiB) does not fit the {free / 2**30:.1f} GiB "
                          "of memory free on this node", hint="unload another model first")
