"""The node's serving side: the engines it runs, what it tells the mesh about them, and its backend.

Loading a model publishes it in the node's peer record (``models.served``) so peers can route to
it; a background task copies the engines' load into the record every few seconds, which the
routers of other nodes read. ``backend`` is what the HTTP routes call: a
:class:`~meshllm.api.mesh_backend.MeshBackend` over the live engine table, so it exists (and
routes to peers) before, while and after models load; a ``--client`` node has no engines and
only routes. Peers' requests arrive on ``"request"`` streams, served by
:class:`~meshllm.api.tunnel_serve.TunnelService` with the same engines.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from pathlib import Path
from typing import Any

from meshllm.api.counters import RequestCounters
from meshllm.api.events import EventHub
from meshllm.api.limits import ApiLimits, Slots
from meshllm.api.mesh_backend import MeshBackend
from meshllm.api.replay import ReplayPolicy
from meshllm.api.tunnel import STREAM_KIND
from meshllm.api.tunnel_serve import TunnelService
from meshllm.engine.base import DEFAULT_MAX_TOKENS, Engine
from meshllm.engine.kernels import Kernels
from meshllm.engine.llama import LlamaEngine
from meshllm.errors import ConfigError
from meshllm.mesh.records import Load, Models, ServedModel
from meshllm.mesh.service import MeshService
from meshllm.models.refs import ModelRef, resolve_model

log = logging.getLogger(__name__)

LOAD_PUBLISH_S = 2.0
ENGINES = ("llama", "ggml")


class Serving:
    """Engines of this node, the backend the API routes call, and the tunnel peers call."""

    def __init__(self, node_id: str, mesh: MeshService, events: EventHub, limits: ApiLimits | None = None,
                 hash_cache: Path | None = None, replay: ReplayPolicy | None = None) -> None:
        """``hash_cache``: JSON file remembering model sha256s (a replay only continues on the same file);
        ``replay``: how routed generations broken mid-answer are continued elsewhere."""
        self.node_id = node_id
        self.mesh = mesh
        self.events = events
        self.engines: dict[str, Engine] = {}
        self.hashes: dict[str, str] = {}
        """sha256 of each engine's model file, by model id (filled in the background after loading)."""
        self.hash_cache = hash_cache
        self.counters = RequestCounters()
        self.backend = MeshBackend(node_id, self.engines, mesh, counters=self.counters, on_event=events.publish,
                                   replay=replay or ReplayPolicy(), hashes=self.hashes)
        self.tunnel = TunnelService(self.engines, Slots((limits or ApiLimits()).max_concurrent), self.counters,
                                    self.hashes)
        self._hashing: set[asyncio.Task[None]] = set()
        assert mesh.endpoint is not None
        mesh.endpoint.on_stream(STREAM_KIND, self.tunnel.handle)
        self._load_task: asyncio.Task[None] | None = None
        self._last_load: Load | None = None

    async def load_models(self, specs: list[str], engine: str = "llama", threads: int | None = None,
                          gpu_layers: int | None = None, parallel: int | None = None,
                          max_tokens_default: int = DEFAULT_MAX_TOKENS, kernels: Kernels = "exact") -> None:
        """Resolve and load each model, then announce them all in our record.

        ``gpu_layers``: layers to offload to the accelerator (None: all that fit); ``parallel`` is the
        llama.cpp engine's slots per model (``None``: sized from memory); ``max_tokens_default``
        caps its requests that set no ``max_tokens``; ``kernels`` picks row-exact or fast ggml kernels (both engines).
        """
        if engine not in ENGINES:
            raise ConfigError(f"unknown engine {engine!r}", hint=f"choose one of {', '.join(ENGINES)}")
        for spec in specs:
            ref = await asyncio.to_thread(resolve_model, spec)
            instance = self._make_engine(engine, ref, threads, gpu_layers, parallel, max_tokens_default, kernels)
            self.events.publish("model_loading", model=ref.model_id, path=str(ref.path), engine=engine,
                                size_bytes=ref.path.stat().st_size)
            started = time.monotonic()
            await instance.load()
            self.engines[instance.model_id] = instance
            self._hash(ref, instance.model_id)
            self.events.publish("model_ready", model=instance.model_id, engine=engine,
                                context=instance.context_length, slots=instance.load_report().slots,
                                load_s=round(time.monotonic() - started, 2))
        self.mesh.update_own(models=Models(served=[
            ServedModel(name=mid, context=e.context_length, engine=engine) for mid, e in self.engines.items()
        ]))
        self._load_task = asyncio.create_task(self._publish_load(), name="publish-load")

    def add_engine(self, engine: Engine, sha256: str | None = None) -> None:
        """Serve an engine built elsewhere (a split model's chain) as a local model; its owner announces it."""
        self.engines[engine.model_id] = engine
        if sha256:
            self.hashes[engine.model_id] = sha256

    def _hash(self, ref: ModelRef, model_id: str) -> None:
        """Learn the model file's sha256 without holding up serving (a big file takes seconds)."""
        if ref.sha256:
            self.hashes[model_id] = ref.sha256
            return

        async def run() -> None:
            try:
                self.hashes[model_id] = (await asyncio.to_thread(ref.hashed, self.hash_cache)).sha256 or ""
            except OSError as exc:
                log.warning("cannot hash %s (replays of its requests take any file of that name): %s", ref.path, exc)

        task = asyncio.create_task(run(), name=f"hash-{model_id}")
        self._hashing.add(task)
        task.add_done_callback(self._hashing.discard)

    @staticmethod
    def _make_engine(engine: str, ref: Any, threads: int | None, gpu_layers: int | None, parallel: int | None,
                     max_tokens_default: int, kernels: Kernels) -> Engine:
        """``gpu_layers``: layers to offload to the accelerator (None: all that fit; 0 on CPU-only nodes)."""
        if engine == "ggml":
            from meshllm.engine.ggml.engine import GgmlEngine

            return GgmlEngine(ref.path, model_id=ref.model_id, threads=threads, gpu_layers=gpu_layers, kernels=kernels)
        from meshllm.engine.capacity import accelerator, llama_gpu_layers

        return LlamaEngine(ref, n_threads=threads, n_gpu_layers=llama_gpu_layers(ref.path, gpu_layers, accelerator()),
                           parallel=parallel, default_max_tokens=max_tokens_default, kernels=kernels)

    async def _publish_load(self) -> None:
        """Copy the engines' load into our record when it changes (gossip spreads it)."""
        while True:
            reports = [e.load_report() for e in self.engines.values()]
            load = Load(in_flight=sum(r.running for r in reports), queue=sum(r.queued for r in reports),
                        tok_s=round(sum(r.tokens_per_s for r in reports), 1), slots=sum(r.slots for r in reports),
                        free_slots=sum(max(0, r.slots - r.running) for r in reports))
            if load != self._last_load:
                self._last_load = load
                self.mesh.update_own(load=load)
            await asyncio.sleep(LOAD_PUBLISH_S)

    def request_counters(self) -> dict[str, Any]:
        """The ``requests`` object of ``/api/status``: totals and requests in the last minute."""
        return self.counters.snapshot(time.time())

    async def close(self) -> None:
        if self._load_task is not None:
            self._load_task.cancel()
        for task in list(self._hashing):
            task.cancel()
        for engine in self.engines.values():
            with contextlib.suppress(Exception):
                await engine.close()
