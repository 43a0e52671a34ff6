"""The node's serving side: the engines it runs, what it tells the mesh about them, and its backend.

Loading a model publishes it in the node's peer record (``models.served``) so peers can route to
it; a background task copies the engines' load into the record every few seconds, which the
routers of other nodes read. ``backend`` is what the HTTP routes call.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

from meshllm.api.backend import LocalBackend
from meshllm.api.events import EventHub
from meshllm.engine.base import Engine
from meshllm.engine.llama import LlamaEngine
from meshllm.errors import ConfigError
from meshllm.mesh.records import Load, Models, ServedModel
from meshllm.mesh.service import MeshService
from meshllm.models.refs import resolve_model

log = logging.getLogger(__name__)

LOAD_PUBLISH_S = 2.0
ENGINES = ("llama", "numpy")


class Serving:
    """Engines of this node and the backend the API routes call."""

    def __init__(self, node_id: str, mesh: MeshService, events: EventHub) -> None:
        self.node_id = node_id
        self.mesh = mesh
        self.events = events
        self.engines: dict[str, Engine] = {}
        self.backend = LocalBackend([], node_id)
        self._load_task: asyncio.Task[None] | None = None
        self._last_load: Load | None = None

    async def load_models(self, specs: list[str], engine: str = "llama") -> None:
        """Resolve and load each model, then announce them all in our record."""
        if engine not in ENGINES:
            raise ConfigError(f"unknown engine {engine!r}", hint=f"choose one of {', '.join(ENGINES)}")
        for spec in specs:
            ref = await asyncio.to_thread(resolve_model, spec)
            instance = self._make_engine(engine, ref)
            self.events.publish("model_loading", model=ref.model_id, path=str(ref.path), engine=engine)
            await instance.load()
            self.engines[instance.model_id] = instance
            self.events.publish("model_ready", model=instance.model_id, engine=engine,
                                context=instance.context_length)
        self.backend = LocalBackend(self.engines.values(), self.node_id)
        self.mesh.update_own(models=Models(served=[
            ServedModel(name=mid, context=e.context_length, engine=engine) for mid, e in self.engines.items()
        ]))
        self._load_task = asyncio.create_task(self._publish_load(), name="publish-load")

    @staticmethod
    def _make_engine(engine: str, ref: Any) -> Engine:
        if engine == "numpy":
            from meshllm.engine.numpy.engine import NumpyEngine

            return NumpyEngine(ref.path, model_id=ref.model_id)
        return LlamaEngine(ref)

    async def _publish_load(self) -> None:
        """Copy the engines' load into our record when it changes (gossip spreads it)."""
        while True:
            reports = [e.load_report() for e in self.engines.values()]
            load = Load(in_flight=sum(r.running for r in reports), queue=sum(r.queued for r in reports),
                        tok_s=round(sum(r.tokens_per_s for r in reports), 1))
            if load != self._last_load:
                self._last_load = load
                self.mesh.update_own(load=load)
            await asyncio.sleep(LOAD_PUBLISH_S)

    def request_counters(self) -> dict[str, Any]:
        """Totals for ``/api/status``."""
        return {"total": 0, "failed": 0, "per_min": 0.0}

    async def close(self) -> None:
        if self._load_task is not None:
            self._load_task.cancel()
        for engine in self.engines.values():
            with contextlib.suppress(Exception):
                await engine.close()
