"""What the HTTP routes call: a :class:`Backend` that lists the mesh's models and generates.

The routes know nothing about engines, peers or QUIC. A node's backend decides where a request
runs (its own engine, or a peer through the request tunnel, chosen by ``meshllm.runtime.router``);
:class:`LocalBackend` serves from engines in this process only, which is what a single machine
and the tests need.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

from meshllm.engine.base import (
    Embeddings,
    EmbedRequest,
    Engine,
    EngineError,
    GenerationEvent,
    GenerationRequest,
)
from meshllm.engine.embed import embed
from meshllm.engine.recommended import admit
from meshllm.runtime.errors import UnknownModel


@dataclass(frozen=True)
class ModelEntry:
    """A model some node of the mesh serves."""

    id: str
    """The API id clients pass as ``model``."""
    nodes: tuple[str, ...]
    """Node ids serving it (this node's own id first when it serves it)."""
    node_names: tuple[str, ...] = ()
    """The same nodes' names, in the same order (for people; ids are what routing uses)."""
    context_length: int | None = None
    created: int = 0
    """Unix time the model became available (OpenAI's ``created``)."""
    tools: bool = False
    """Its chat template renders tools itself (others get them emulated)."""
    slots: int = 0
    """Requests its nodes can generate at once (0: not reported)."""
    free_slots: int = 0
    busy: int = 0
    """Requests running or queued on its nodes."""
    tok_s: float = 0.0
    """The fastest recent decode speed of its nodes (0: not measured yet)."""


class Backend(Protocol):
    """The routes' only dependency."""

    def models(self) -> Sequence[ModelEntry]:
        """Every model in the mesh with the nodes serving it."""
        ...

    def generate(self, request: GenerationRequest) -> AsyncIterator[GenerationEvent]:
        """Stream the events of ``request``.

        Raise :class:`~meshllm.runtime.errors.UnknownModel` if no node serves ``request.model``, and
        any error *before* the first event if the request cannot be served (the client then gets
        a proper status code). Closing the iterator must cancel the generation wherever it runs.
        """
        ...

    async def embed(self, request: EmbedRequest) -> Embeddings:
        """The embeddings of ``request``'s inputs, wherever the model is served (errors as for ``generate``)."""
        ...


class LocalBackend:
    """Serves the models of engines loaded in this process."""

    def __init__(self, engines: Iterable[Engine], node_id: str = "local") -> None:
        self.node_id = node_id
        self.engines = {engine.model_id: engine for engine in engines}
        self._created = int(time.time())

    def models(self) -> Sequence[ModelEntry]:
        """One entry per engine, served by this node."""
        return [local_entry(mid, engine, self.node_id, self.node_id, self._created)
                for mid, engine in sorted(self.engines.items()) if engine.listed]

    def generate(self, request: GenerationRequest) -> AsyncIterator[GenerationEvent]:
        """The engine's stream for ``request.model``."""
        engine = self.engines.get(request.model)
        if engine is None:
            raise UnknownModel(f"model {request.model!r} is not served here")
        return engine.generate(admit(engine, request))

    async def embed(self, request: EmbedRequest) -> Embeddings:
        """The engine's embeddings for ``request.model``."""
        engine = self.engines.get(request.model)
        if engine is None:
            raise UnknownModel(f"model {request.model!r} is not served here")
        return await embed(engine, request)


def local_entry(model_id: str, engine: Engine, node_id: str, name: str, created: int) -> ModelEntry:
    """The listing entry of a model this node's ``engine`` serves, with its load now."""
    report = engine.load_report()
    return ModelEntry(id=model_id, nodes=(node_id,), node_names=(name,), context_length=engine_context(engine),
                      created=created, tools=engine.native_tools, slots=report.slots,
                      free_slots=max(0, report.slots - report.running - report.queued),
                      busy=report.running + report.queued, tok_s=report.tokens_per_s)


def engine_context(engine: Engine) -> int | None:
    """The engine's context length, or ``None`` while it is not loaded."""
    try:
        return engine.context_length
    except EngineError:  # not loaded yet: the listing still shows the model
        return None
