"""GgmlEngine: the whole model as one ggml stage, behind the shared :class:`Engine` interface.

``meshllm serve --engine ggml`` serves with it, so the stage runtime that splits run on is exercised end
to end through the same API as llama.cpp (and gives the same greedy text: its logits are llama.cpp's).
Each forward step (and the sampling after it) runs on the engine's compute runner
(:class:`~meshllm.compute.Runner`: one thread, the prompt a prefill job, each next token a decode
job); the event loop only moves tokens. Requests take turns (one generates at a time); a consumer
that stops iterating cancels its request before the next token, and its KV and grammar are freed by
a job of their own, after the step in flight.

It honours token-id prompts, a request's ``continuation`` (fed silently through the text core and the
grammar, and computed as the engine that began the request computed it: :meth:`GgmlEngine._replay`),
grammars (llama.cpp's grammar sampler over the vocabulary loaded alone, on the first request that has
one: :mod:`meshllm.engine.constrained`) and logprobs (of the raw logits, as the llama.cpp engine
reports them).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import TypeVar

import numpy as np

from meshllm.compute import Priority, Runner, RunnerClosed, RunnerError
from meshllm.engine.base import (
    GRAMMAR,
    LOGPROBS,
    REPLAY_STEPS_S,
    TOKEN_PROMPTS,
    Engine,
    EngineBusy,
    EngineError,
    EngineNotLoaded,
    GenerationEvent,
    GenerationParams,
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

log = logging.getLogger(__name__)
T = TypeVar("T")


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
        replay_steps_s: float = REPLAY_STEPS_S,
    ) -> None:
        """``replay_steps_s``: the longest a continuation is decoded one row per step (:meth:`_replay`)."""
        self.path = model.path if isinstance(model, ModelRef) else Path(model)
        self.model_id = model_id or (model.model_id if isinstance(model, ModelRef) else self.path.stem)
        self._n_ctx = n_ctx
        self._threads = threads
        self._gpu_layers = gpu_layers
        self._kernels = kernels
        self.max_queue = max_queue
        self.queue_timeout_s = queue_timeout_s
        self.replay_steps_s = replay_steps_s
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
        self._step_s = 0.0
        """Recent time of a one-row step (exponential average): what a replay's steps are predicted at."""
        self.replay_rows = 0
        """Continuation tokens replayed as one-row steps (the rest of each continuation was prefilled)."""

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
            pos = await self._replay(session, prompt, fed, params) if fed and not text.done else 0
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
        return await self._on_runner(pos, lambda: self._step(session, history, pos, sampler, logprobs))

    async def _on_runner(self, pos: int, job: Callable[[], T]) -> T:
        """Run one forward ``job`` on the runner: a prefill job from position 0, else a decode job."""
        try:
            return await self._runner.run("step", False, job,
                                          priority=Priority.PREFILL if pos == 0 else Priority.DECODE)
        except RunnerClosed:
            raise EngineNotLoaded(f"model {self.model_id} was unloaded during the request") from None
        except RunnerError as exc:
            raise EngineError(f"model {self.model_id}: {exc}") from exc

    async def _replay(self, session: str, prompt: list[int], fed: list[int], params: GenerationParams) -> int:
        """Compute the KV of ``prompt`` and ``fed[:-1]`` as the engine that began the request did; the
        positions computed (the caller feeds the rest in one call, and samples after it).

        That engine prefilled the prompt in one call and computed each token it generated in a one-row
        step. A prefill of the generated tokens is one call but can give other logits (ggml's attention
        takes another kernel for one query row than for several: on SmolLM2-135M the greedy text left
        the uninterrupted one, docs/architecture.md), so the tokens are fed one row per step while the
        steps left are predicted, at the recent step time, to end within :attr:`replay_steps_s` of the
        replay's start; past that, the caller prefills the rest. Where the request's draws can be
        recomputed (greedy, or seeded, and no grammar), each step's logits are checked against the next
        token; one the model would not have produced here (the first engine computed otherwise:
        another kernel, another engine) is logged and the replay goes on (the tokens were sent).
        """
        checker = Sampler(params) if params.grammar is None and (params.temperature <= 0 or params.seed is not None) \
            else None
        history = list(prompt)
        started = time.perf_counter()
        logits = await self._on_runner(0, lambda: self._forward(session, prompt, 0))
        for i, token in enumerate(fed):
            if checker is not None and checker(logits, history) != token:
                log.warning("model %s: replayed token %d (%d) is not what this engine computes there; the request "
                            "began on another engine or kernels", self.model_id, i, token)
                checker = None
            left = len(fed) - i  # one-row steps to go, the caller's last one included
            if i == len(fed) - 1 or time.perf_counter() - started + left * self._step_s > self.replay_steps_s:
                break
            pos = len(history)
            logits = await self._on_runner(pos, lambda t=token, p=pos: self._forward(session, [t], p))
            history.append(token)
            self.replay_rows += 1
        return len(history)

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

    def _forward(self, session: str, tokens: list[int], pos: int) -> np.ndarray:
        """Worker thread: feed ``tokens`` at ``pos``; the logits after the last. Times one-row steps."""
        stage = self.stage
        if stage is None:
            raise EngineNotLoaded(f"model {self.model_id} was unloaded during the request")
        started = time.perf_counter()
        try:
            logits = stage.forward(session, np.asarray(tokens, dtype=np.int64), pos, last_only=True)[-1]
        except StageInputError as exc:
            raise EngineNotLoaded(f"model {self.model_id}: {exc}") from exc
        if len(tokens) == 1:
            took = time.perf_counter() - started
            self._step_s = took if not self._step_s else 0.8 * self._step_s + 0.2 * took
        return logits

    def _step(self, session: str, history: list[int], pos: int, sampler: Sampler,
              logprobs: int | None) -> tuple[int | None, TokenLogprob | None]:
        """Worker thread: feed ``history[pos:]``, sample the next token (``None``: the grammar is complete)
        and, when asked, its logprobs."""
        logits = self._forward(session, history[pos:], pos)
        tokenizer = self.tokenizer
        if tokenizer is None:
            raise EngineNotLoaded(f"model {self.model_id} was unloaded during the request")
        token = sampler(logits, history)
        if token is None or logprobs is None:
            return token, None
        return token, logprob_entry(tokenizer.token_bytes, token, *token_logprobs(logits, token, logprobs))
