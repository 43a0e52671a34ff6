"""SplitEngine: a model served by a chain of stages, behind the same :class:`Engine` interface as a local model.

The API routes cannot tell it from :class:`~meshllm.engine.ggml.engine.GgmlEngine`: it tokenizes
(the coordinator holds the tokenizer), streams text with stop strings cut, and reports usage. The chain
itself is swappable: placement (:mod:`meshllm.split.placement`) attaches a :class:`SplitCoordinator`
when a plan is hosted and detaches it when a stage fails; meanwhile requests get a 503 that says why,
instead of hanging on a chain that no longer exists.

End of generation is decided here, not on the last stage (no stop ids go down the chain): the next
``Decode`` is only sent after the previous token was consumed, so stopping costs no wasted step.

Grammars and logprobs are the last stage's work, since it samples: the request's grammar goes down
in the session's :class:`~meshllm.split.frames.Sampling` (checked here first, so a bad one is a 400
before the chain sees it), with the continuation it has already produced, and each
:class:`~meshllm.split.frames.Tokens` brings the tokens' logprobs back as ids, which get their text here.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import AsyncIterator, Sequence
from pathlib import Path

from meshllm.engine.base import (
    Engine,
    EngineError,
    EngineNotLoaded,
    GenerationEvent,
    GenerationParams,
    GenerationRequest,
    LoadReport,
    TokenLogprob,
    TokenRate,
    check_supported,
    context_cap,
)
from meshllm.engine.gbnf import check_grammar
from meshllm.engine.ggml.engine import SUPPORTS, replay
from meshllm.engine.sampler import check_logprobs, logprob_entry, sampling_params
from meshllm.engine.text import TextStream, token_budget
from meshllm.engine.tokenizer import Tokenizer
from meshllm.models.metadata import read_metadata
from meshllm.split.coordinator import SplitCoordinator, SplitToken
from meshllm.split.errors import StageFailed
from meshllm.split.frames import Sampling


class ChainUnavailable(EngineNotLoaded):
    """No chain serves the model right now (planning, replanning, or a stage just failed): HTTP 503.

    Not :class:`EngineBusy`: a chain being rebuilt is not a saturated node, so a request that finds
    no other server gets a 503, not a 429 telling the client the mesh is full."""

    hint = "the node is rebuilding the chain; retry in a few seconds"


def chain_sampling(params: GenerationParams, generated: Sequence[int] = ()) -> Sampling:
    """OpenAI semantics for the last stage's sampler (no min-p, no repetition penalty), as GgmlEngine,
    with the request's grammar (checked here: :class:`~meshllm.engine.gbnf.BadGrammar`), the tokens of
    its continuation the grammar has produced (``generated``), and the logprobs it asks for."""
    check_logprobs(params)
    grammar = params.grammar or None
    if grammar is not None:
        check_grammar(grammar)
    return Sampling(**dataclasses.asdict(sampling_params(params)), grammar=grammar, logprobs=params.logprobs,
                    generated=list(generated) if grammar else [])


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
        return LoadReport(running=self._running, queued=0, max_queue=0, tokens_per_s=round(self._rate.value, 2))

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
        sampling = chain_sampling(request.params, fed)
        started = time.monotonic()
        self._running += 1
        tokens = coordinator.generate(prompt + fed, max_tokens=max(limit - len(fed), 1), sampling=sampling)
        try:
            async for token in tokens:
                logprob = None if sampling.logprobs is None else self._logprob(tokenizer, token)
                delta = text.feed(token.token_id, last=bool(token.finish), logprob=logprob)
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
        for event in text.finish():
            yield event

    @staticmethod
    def _logprob(tokenizer: Tokenizer, token: SplitToken) -> TokenLogprob:
        """The engine contract's logprob entry for a token the last stage reported figures for."""
        if token.logprobs is None:
            raise EngineError("the chain's last stage sent no logprobs for a request that asked for them")
        return logprob_entry(tokenizer.token_bytes, token.token_id, token.logprobs.logprob, token.logprobs.top)

