"""GgmlEngine: the whole model as one ggml stage, behind the shared :class:`Engine` interface.

``meshllm serve --engine ggml`` serves with it, so the stage runtime that splits run on is exercised end
to end through the same API as llama.cpp (and gives the same greedy text: its logits are llama.cpp's).
Each forward step (and the sampling after it) runs on the engine's compute runner
(:class:`~meshllm.compute.Runner`: one thread, the prompt a prefill job, each next token a decode
job); the event loop only moves tokens. Requests take turns (one generates at a time); a consumer
that stops iterating cancels its request before the next token, and its KV and grammar are freed by
a job of their own, after the step in flight.

It honours token-id prompts, a request's ``continuation`` (prefilled with the prompt and fed
silently through the text core and the grammar), grammars (llama.cpp's grammar sampler over the
vocabulary loaded alone, on the first request that has one: :mod:`meshllm.engine.constrained`) and
logprobs (of the raw logits, as the llama.cpp engine reports them).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import numpy as np

from meshllm.compute import Priority, Runner, RunnerClosed, RunnerError
from meshllm.engine.base import (
    GRAMMAR,
    LOGPROBS,
    TOKEN_PROMPTS,
    Engine,
    EngineBusy,
    EngineError,
    EngineNotLoaded,
    GenerationEvent,
    GenerationRequest,
    LoadReport,
    TokenLogprob,
    TokenRate,
    Unsupported,
    check_supported,
    context_cap,
)
from meshllm.engine.constrained import Grammar, Vocab
from meshllm.engine.gbnf import check_grammar
from meshllm.engine.ggml.errors import StageInputError
from meshllm.engine.ggml.stage import StageModel
from meshllm.engine.kernels import Kernels
from meshllm.engine.sampler import Sampler, check_logprobs, logprob_entry, token_logprobs
from meshllm.engine.text import TextStream, token_budget
from meshllm.engine.tokenizer import Tokenizer
from meshllm.models.metadata import read_metadata
from meshllm.models.refs import ModelRef

SUPPORTS = frozenset({GRAMMAR, LOGPROBS, TOKEN_PROMPTS})
"""Optional request features the ggml runtime's engines honour (the engine contract's capability names)."""


def replay(text: TextStream, request: GenerationRequest, vocab: int) -> list[int]:
    """Feed ``request.continuation`` (sent to the client by the engine that began it) silently to ``text``.

    Returns the tokens fed, which follow the prompt in what the engine prefills; generation ends at
    once if they already ended it. Ids outside the vocabulary are refused.
    """
    if any(not 0 <= t < vocab for t in request.continuation):
        raise Unsupported("the continuation has a token id outside the vocabulary", param="continuation")
    fed: list[int] = []
    for token in request.continuation:
        if text.done:
            break
        text.replay((token,))
        fed.append(token)
    return fed


class GgmlEngine(Engine):
    """Serve one GGUF with the ggml stage runtime (layers [0, n) in one stage)."""

    supports = SUPPORTS

    def __init__(
        self,
        model: ModelRef | Path,
        *,
        model_id: str | None = None,
        n_ctx: int | None = None,
        threads: int | None = None,
        gpu_layers: int | None = None,
        kernels: Kernels = "exact",
        max_queue: int = 32,
        queue_timeout_s: float = 120.0,
    ) -> None:
        self.path = model.path if isinstance(model, ModelRef) else Path(model)
        self.model_id = model_id or (model.model_id if isinstance(model, ModelRef) else self.path.stem)
        self._n_ctx = n_ctx
        self._threads = threads
        self._gpu_layers = gpu_layers
        self._kernels = kernels
        self.max_queue = max_queue
        self.queue_timeout_s = queue_timeout_s
        self.stage: StageModel | None = None
        self.tokenizer: Tokenizer | None = None
        self._vocab: Vocab | None = None
        """The vocabulary for grammars, loaded by the first request that has one."""
        self._turn = asyncio.Lock()
        """Held by the request generating (requests take turns; the runner orders their steps)."""
        self._runner = Runner(f"ggml-{self.model_id}")
        self._queued = 0
        self._running = 0
        self._rate = TokenRate()

    async def load(self) -> None:
        """Map the model and load its tokenizer, off the event loop."""
        self.stage, self.tokenizer = await asyncio.to_thread(self._load_blocking)

    def _load_blocking(self) -> tuple[StageModel, Tokenizer]:
        meta = read_metadata(self.path)
        stage = StageModel.load(self.path, max_context=context_cap(meta.context_length, self._n_ctx),
                                threads=self._threads, gpu_layers=self._gpu_layers, kernels=self._kernels)
        return stage, Tokenizer(self.path, meta.architecture, meta.chat_template)

    async def close(self) -> None:
        """Free the model; a request in flight fails at its next token with :class:`EngineNotLoaded`."""
        stage, tokenizer = self.stage, self.tokenizer
        self.stage = self.tokenizer = None
        self._vocab = None  # freed once no request's grammar holds it

        def free() -> None:
            if tokenizer is not None:
                tokenizer.close()
            if stage is not None:
                stage.close()

        # after the step in flight, which may use both (a request's next step then finds no model)
        closed = self._runner.submit("close", free, priority=Priority.PREFILL) if stage or tokenizer else None
        await self._runner.aclose()
        if closed is not None:
            closed.result()

    @property
    def context_length(self) -> int:
        """Tokens per request (prompt plus completion)."""
        return self._require()[0].max_context

    def load_report(self) -> LoadReport:
        """Running/queued requests and the recent decode speed."""
        return LoadReport(
            running=self._running, queued=self._queued, max_queue=self.max_queue,
            tokens_per_s=round(self._rate.value, 2),
        )

    def _require(self) -> tuple[StageModel, Tokenizer]:
        if self.stage is None or self.tokenizer is None:
            raise EngineNotLoaded(f"model {self.model_id} is not loaded")
        return self.stage, self.tokenizer

    def prompt_tokens(self, request: GenerationRequest) -> tuple[list[int], tuple[str, ...]]:
        """The tokens fed for ``request`` and its stop strings (the client's plus the chat format's)."""
        stage, tokenizer = self._require()
        return tokenizer.request_prompt(request, self.model_id, stage.max_context)

    async def generate(self, request: GenerationRequest) -> AsyncIterator[GenerationEvent]:
        """Wait for a turn, then stream ``request``'s text and one :class:`Finish`."""
        self._require()
        check_supported(self, request)
        if self._queued >= self.max_queue:
            raise EngineBusy(f"model {self.model_id} has {self._queued} requests queued (limit {self.max_queue})")
        self._queued += 1
        try:
            await asyncio.wait_for(self._turn.acquire(), self.queue_timeout_s)
        except TimeoutError:
            raise EngineBusy(
                f"model {self.model_id}: request waited {self.queue_timeout_s:.0f}s for its turn"
            ) from None
        finally:
            self._queued -= 1
        self._running += 1
        try:
            async for event in self._generate(request):
                yield event
        finally:
            self._running -= 1
            self._turn.release()

    async def _generate(self, request: GenerationRequest) -> AsyncIterator[GenerationEvent]:
        stage, tokenizer = self._require()
        params = request.params
        check_logprobs(params)
        prompt, stop_strings = await asyncio.to_thread(self.prompt_tokens, request)
        limit = token_budget(len(prompt), stage.max_context, params.max_tokens, self.model_id)
        text = TextStream(is_end=tokenizer.is_end, token_bytes=tokenizer.token_bytes, stops=stop_strings,
                          limit=limit, prompt_tokens=len(prompt),
                          end_on_repeated_call=request.params.end_on_repeated_call)
        fed = replay(text, request, stage.hparams.vocab)
        grammar = None
        if params.grammar and not text.done:
            grammar = await asyncio.to_thread(self._grammar, params.grammar, fed)
        sampler = Sampler(params, grammar, step=len(fed))
        history = prompt + fed
        session = uuid.uuid4().hex
        started = time.monotonic()
        try:
            pos = 0
            while not text.done:
                token, logprob = await self._run_step(session, history, pos, sampler, params.logprobs)
                if token is None:  # the grammar allows nothing more: the text is complete
                    text.reason, text.done = "stop", True
                    break
                pos = len(history)
                history.append(token)
                delta = text.feed(token, logprob=logprob)
                if delta is not None:
                    yield delta
        except BaseException:  # cancelled or failed: freed after a step of it that may still be running
            self._free(session, grammar)
            raise
        finally:
            self._rate.observe(text.generated - len(fed), started, time.monotonic())
        freed = self._free(session, grammar)
        if freed is not None:  # (freed before the Finish: a request that ended leaves no KV behind)
            try:
                await self._runner.wait(freed, kind="freeing a request")
            except RunnerError as exc:
                raise EngineError(f"model {self.model_id}: {exc}") from exc
        for event in text.finish():
            yield event

    async def _run_step(self, session: str, history: list[int], pos: int, sampler: Sampler,
                        logprobs: int | None) -> tuple[int | None, TokenLogprob | None]:
        """:meth:`_step` on the runner (the first, over the prompt, as a prefill job)."""
        try:
            return await self._runner.run("step", False, lambda: self._step(session, history, pos, sampler, logprobs),
                                          priority=Priority.PREFILL if pos == 0 else Priority.DECODE)
        except RunnerClosed:
            raise EngineNotLoaded(f"model {self.model_id} was unloaded during the request") from None
        except RunnerError as exc:
            raise EngineError(f"model {self.model_id}: {exc}") from exc

    def _free(self, session: str, grammar: Grammar | None) -> concurrent.futures.Future[None] | None:
        """Queue the freeing of ``session``'s KV and its grammar as a job of their own: a step of it may
        still be running (its caller cancelled), and this runs after it. ``None`` once the engine closed
        (its stage freed every session; the grammar goes with its object)."""

        def free() -> None:
            if self.stage is not None:
                self.stage.reset(session)
            if grammar is not None:
                grammar.close()

        try:
            return self._runner.submit("free", free)
        except RunnerClosed:
            return None

    def _grammar(self, text: str, fed: list[int]) -> Grammar:
        """Worker thread: ``text`` compiled over the model's vocabulary, advanced over the continuation."""
        vocab = self._vocab
        if vocab is None:
            check_grammar(text)  # a bad grammar is refused before the vocabulary is loaded for it
            self._vocab = vocab = Vocab(self.path)
        grammar = Grammar(vocab, text)
        try:
            grammar.replay(fed)
        except BaseException:
            grammar.close()
            raise
        return grammar

    def _step(self, session: str, history: list[int], pos: int, sampler: Sampler,
              logprobs: int | None) -> tuple[int | None, TokenLogprob | None]:
        """Worker thread: feed ``history[pos:]``, sample the next token (``None``: the grammar is complete)
        and, when asked, its logprobs."""
        stage, tokenizer = self.stage, self.tokenizer
        if stage is None or tokenizer is None:
            raise EngineNotLoaded(f"model {self.model_id} was unloaded during the request")
        try:
            logits = stage.forward(session, np.asarray(history[pos:], dtype=np.int64), pos, last_only=True)[-1]
        except StageInputError as exc:
            raise EngineNotLoaded(f"model {self.model_id}: {exc}") from exc
        token = sampler(logits, history)
        if token is None or logprobs is None:
            return token, None
        return token, logprob_entry(tokenizer.token_bytes, token, *token_logprobs(logits, token, logprobs))
