"""SplitEngine: a model served by a chain of stages, behind the same :class:`Engine` interface as a local model.

The API routes cannot tell it from :class:`~meshllm.engine.ggml.engine.GgmlEngine`: it tokenizes
(the coordinator holds the tokenizer), streams text with stop strings cut, and reports usage. The chain
itself is swappable: placement (:mod:`meshllm.split.placement`) attaches a :class:`SplitCoordinator`
when a plan is hosted and detaches it when a stage fails; meanwhile requests get a 503 that says why,
instead of hanging on a chain that no longer exists.

End of generation is decided here, not on the last stage (no stop ids go down the chain): the next
``Decode`` is only sent after the previous token was consumed, so stopping costs no wasted step.
"""

from __future__ import annotations

import asyncio
import dataclasses
import secrets
import time
import uuid
from collections.abc import AsyncIterator, Callable
from pathlib import Path

from meshllm.engine.base import (
    Engine,
    EngineNotLoaded,
    GenerationEvent,
    GenerationParams,
    GenerationRequest,
    LoadReport,
    TokenRate,
    check_supported,
    context_cap,
)
from meshllm.engine.ggml.engine import SUPPORTS, replay
from meshllm.engine.sampler import sampling_params
from meshllm.engine.text import TextStream, token_budget
from meshllm.engine.tokenizer import Tokenizer
from meshllm.models.metadata import read_metadata
from meshllm.split.auditor import FinishedRequest
from meshllm.split.coordinator import SplitCoordinator
from meshllm.split.errors import StageFailed
from meshllm.split.frames import Sampling


class ChainUnavailable(EngineNotLoaded):
    """No chain serves the model right now (planning, replanning, or a stage just failed): HTTP 503.

    Not :class:`EngineBusy`: a chain being rebuilt is not a saturated node, so a request that finds
    no other server gets a 503, not a 429 telling the client the mesh is full."""

    hint = "the node is rebuilding the chain; retry in a few seconds"


def chain_sampling(params: GenerationParams) -> Sampling:
    """OpenAI semantics for the last stage's sampler (no min-p, no repetition penalty), as GgmlEngine.

    A sampled request without a seed gets a fresh random one here rather than on the last stage, so
    the coordinator can recompute its draws in an audit (the text is as random either way).
    """
    sampling = sampling_params(params)
    if sampling.temperature > 0 and sampling.seed is None:
        sampling = dataclasses.replace(sampling, seed=secrets.randbits(63))
    return Sampling(**dataclasses.asdict(sampling))


class SplitEngine(Engine):
    """Serves ``model_id`` through whichever chain is attached; 503 while none is."""

    supports = SUPPORTS

    def __init__(self, path: Path, model_id: str, max_context: int) -> None:
        self.path = path
        self.model_id = model_id
        self.max_context = max_context
        self.tokenizer: Tokenizer | None = None
        self.coordinator: SplitCoordinator | None = None
        self.unavailable = "planning the chain"
        """Why no chain is attached (shown in the 503)."""
        self._running = 0
        self._rate = TokenRate()
        self.on_finished: Callable[[SplitCoordinator, FinishedRequest], None] | None = None
        """Told about every request the chain served to its end (the node's audits)."""

    async def load(self) -> None:
        """Load only the tokenizer (the layers are loaded by placement, per plan); cap the context at the model's."""
        self.tokenizer = await asyncio.to_thread(self._load_tokenizer)

    def _load_tokenizer(self) -> Tokenizer:
        meta = read_metadata(self.path)
        self.max_context = context_cap(meta.context_length, cap=self.max_context)
        return Tokenizer(self.path, meta.architecture, meta.chat_template)

    async def close(self) -> None:
        if self.tokenizer is not None:
            self.tokenizer.close()
        self.tokenizer = None
        self.detach("closed")

    def attach(self, coordinator: SplitCoordinator) -> None:
        """Serve new requests through ``coordinator``'s chain."""
        self.coordinator = coordinator

    def detach(self, reason: str) -> None:
        """Stop taking requests until the next :meth:`attach`; ``reason`` goes into the 503s."""
        self.coordinator = None
        self.unavailable = reason

    @property
    def context_length(self) -> int:
        return self.max_context

    def load_report(self) -> LoadReport:
        """Slots are the chain's batch (requests decoding in one pass); none while no chain is attached."""
        slots = self.coordinator.batch if self.coordinator is not None else 0
        return LoadReport(running=self._running, slots=slots, queued=0, max_queue=0,
                          tokens_per_s=round(self._rate.value, 2))

    def prompt_tokens(self, request: GenerationRequest) -> tuple[list[int], tuple[str, ...]]:
        """The tokens fed for ``request`` and its stop strings (the client's plus the chat format's)."""
        if self.tokenizer is None:
            raise EngineNotLoaded(f"model {self.model_id} is not loaded")
        return self.tokenizer.request_prompt(request, self.model_id)

    async def generate(self, request: GenerationRequest) -> AsyncIterator[GenerationEvent]:
        """Stream ``request`` through the chain; a failed stage ends it with :class:`ChainUnavailable`."""
        coordinator, tokenizer = self.coordinator, self.tokenizer
        if tokenizer is None:
            raise EngineNotLoaded(f"model {self.model_id} is not loaded")
        if coordinator is None:
            raise ChainUnavailable(f"split model {self.model_id} is not available: {self.unavailable}")
        check_supported(self, request)
        # A long prompt takes seconds to tokenize: never on the event loop.
        prompt, stop_strings = await asyncio.to_thread(self.prompt_tokens, request)
        limit = token_budget(len(prompt), self.max_context, request.params.max_tokens, self.model_id)
        text = TextStream(is_end=tokenizer.is_end, token_bytes=tokenizer.token_bytes, stops=stop_strings,
                          limit=limit, prompt_tokens=len(prompt))
        fed = replay(text, request, coordinator.first.hparams.vocab)
        if text.done:
            for event in text.finish():
                yield event
            return
        started = time.monotonic()
        self._running += 1
        session, sampling, returned = uuid.uuid4().hex, chain_sampling(request.params), []
        tokens = coordinator.generate(prompt + fed, max_tokens=max(limit - len(fed), 1), sampling=sampling,
                                      session=session)
        try:
            async for token in tokens:
                returned.append(token.token_id)
                delta = text.feed(token.token_id, last=bool(token.finish))
                if delta is not None:
                    yield delta
                if text.done:
                    break
        except StageFailed as exc:
            raise ChainUnavailable(str(exc)) from exc
        finally:
            await tokens.aclose()
            self._running -= 1
            self._rate.observe(text.generated - len(fed), started, time.monotonic())
        if self.on_finished is not None:
            self.on_finished(coordinator, FinishedRequest(session, prompt + fed, returned, sampling))
        for event in text.finish():
            yield event

