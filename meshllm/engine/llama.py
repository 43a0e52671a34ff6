"""LlamaEngine: one llama.cpp context, ``--parallel`` slots, one batch per step (continuous batching).

Requests wait in a fair queue for a slot (a sequence of the context with its own KV). The engine's
compute runner (:class:`~meshllm.compute.Runner`, one thread) runs the steps the sans-IO
:class:`~meshllm.engine.slots.Scheduler` plans, one job per step, each queueing the next while there
is work: one decode batch holding every generating slot's next token, then prefill chunks of new
prompts (at most one chunk's worth of tokens per step, so a long prompt never stalls the others for
longer than that).
Each slot samples with its own llama.cpp sampler chain and grammar
(:mod:`meshllm.engine.llama_sampling`) and turns tokens into text with the shared
:class:`~meshllm.engine.text.TextStream`. The event loop never blocks: tokenizing runs in a thread,
and events cross from the runner's thread to the loop with ``call_soon_threadsafe``.

**Same request, same answer.** A request's output does not depend on what the engine ran before:
prompts are prefilled on a fixed chunk grid and a slot's cached prompt is lent only in whole grid
chunks (:mod:`meshllm.engine.prompt_cache`), so a cache hit reproduces the KV a fresh prefill
would compute. Whether it depends on what runs *beside* it is up to llama.cpp's kernels: with
``kernels="exact"`` (the default) the model is loaded without repacked weights and ggml's tiled
matmul is off, which leaves kernels that compute a row the same way in any batch, except that a
lone row of float weights differs from a pair (measured at load, :func:`lone_row_differs`); then
every call gets a second row (a padding row in a neighbouring sequence, or the prompt's last two
positions). A continuation is decoded token by token, as its first engine did (without the output
head where the kernels are row-exact: its next token is known). docs/llama-engine.md
has the measurements.

**Speculative decoding** (:mod:`meshllm.engine.speculate`, ``speculate`` off/on/auto): a generating
slot drafts the next tokens from n-grams of its prompt and text and adds them to the step's batch
as a window (its token plus ``k`` drafts, logits for each); the slot keeps the longest prefix its
sampler agrees with plus the sampler's own next token, and the rejected positions leave its KV.
That is only exact where llama.cpp computes a window's rows as it computes single rows: measured
at load (:func:`probe_windows`) under llama.cpp's softmax attention (the stage runtime's too, so
split chains and ``--engine ggml`` give the same text); where it is not (float weights; softmax
attention over shared keys, as on the default model), speculation is unavailable and the engine
says so in its status.
The window's size comes from the measured call costs by row count and the acceptance rate, priced
for the whole step (:func:`~meshllm.engine.speculate.batch_cost`): a step that is already wide
gets narrow windows or none.

Closing a request's iterator frees its slot at the next step boundary (one step: milliseconds on
small models, one decode batch plus at most one chunk on large ones).
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import logging
import statistics
import threading
import time
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from meshllm.compute import ComputeTimeout, Priority, Runner
from meshllm.engine.base import (
    DEFAULT_MAX_TOKENS,
    GRAMMAR,
    LOGPROBS,
    REPLAY_STEPS_S,
    TOKEN_PROMPTS,
    BadChat,
    ChatRequest,
    Engine,
    EngineBusy,
    EngineError,
    EngineNotLoaded,
    Finish,
    GenerationEvent,
    GenerationRequest,
    InvalidRequest,
    LoadReport,
    TokenRate,
    context_cap,
    default_threads,
)
from meshllm.engine.capacity import total_ram_bytes
from meshllm.engine.chat_format import ChatTemplate, chat_renderer
from meshllm.engine.fair_queue import QueueFull
from meshllm.engine.kernels import Kernels, use_kernels
from meshllm.engine.slots import CallCosts, Chunk, DecodeRow, Scheduler, Step
from meshllm.engine.speculate import (
    Acceptance,
    NgramDrafter,
    SpecStats,
    SpeculateMode,
    WindowPolicy,
    batch_cost,
    expected_tokens,
    verify_window,
)
from meshllm.engine.text import TextStream, token_budget, tokenize_bounded
from meshllm.models.metadata import ArrayInfo, GGUFMetadata, read_metadata
from meshllm.models.refs import ModelRef

log = logging.getLogger(__name__)

MAX_DEFAULT_PARALLEL = 8
"""``--parallel`` when not given is at most this: on a CPU, batches past 8 rows add little."""
KV_MEMORY_SHARE = 0.25
"""Share of the memory available at load that the default slot count may spend on KV caches."""
PREFILL_CHUNK = 64
"""Tokens per prefill chunk: the grid prompts are prefilled on, and the prefill work per step."""
WINDOW = 8
"""Most drafts one slot verifies in a step (its window is one row more; :func:`probe_windows` checks that size)."""
EMPTY_STEP_RETRY_S = 0.05
"""When a step has nothing to run but requests wait (for a slot to free), when to plan again."""


@dataclass
class EngineStats:
    """Lifetime counters; tests, benchmarks and the status page read them."""

    requests: int = 0
    completed: int = 0
    cancelled: int = 0
    rejected: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    """Prompt tokens taken from a slot's cache instead of computed."""
    decode_calls: int = 0
    decode_rows: int = 0
    """Generated tokens decoded, over ``decode_calls`` batches (their ratio is the mean batch)."""
    headless_rows: int = 0
    """Of ``decode_rows``, continuation tokens decoded without the output head (their next token is known)."""
    prefill_chunks: int = 0


@dataclass(eq=False)
class _Job:
    """One request from ``generate`` to its last event."""

    request: GenerationRequest
    prompt_len: int
    target: tuple[int, ...]
    """The prompt: what the slot prefills."""
    forced: collections.deque[int]
    """Continuation tokens still to decode before sampling resumes (generated elsewhere, already sent)."""
    text: TextStream
    sampler: Any
    """Its :class:`~meshllm.engine.llama_sampling.SlotSampler` (``None`` when it needs no slot)."""
    client: str
    drafter: NgramDrafter | None = None
    """Its prompt and text indexed for drafts (``None``: no speculation)."""
    policy: WindowPolicy | None = None
    loop: asyncio.AbstractEventLoop | None = None
    events: asyncio.Queue[GenerationEvent | BaseException] = field(default_factory=asyncio.Queue)
    cancelled: bool = False
    ended: bool = False
    """The worker is done with it (finished, failed or refused)."""
    started: float = 0.0

    def emit(self, item: GenerationEvent | BaseException) -> None:
        """Hand an event to the consumer's loop (called on the worker thread)."""
        if self.loop is not None and not self.cancelled:
            self.loop.call_soon_threadsafe(self.events.put_nowait, item)


class LlamaEngine(Engine):
    """Serve one GGUF with llama.cpp, ``parallel`` requests at once.

    ``n_ctx`` is each slot's context (default: the model's trained context capped at
    ``DEFAULT_MAX_CONTEXT``); ``parallel`` the number of slots (default: up to
    :data:`MAX_DEFAULT_PARALLEL`, as many as a quarter of the free memory holds). ``max_queue`` bounds
    waiting requests, ``queue_timeout_s`` how long one may wait; ``default_max_tokens`` caps requests
    that set no ``max_tokens``. ``kernels`` picks row-exact or fast llama.cpp kernels (see :data:`Kernels`;
    ``exact`` holds for the whole process). ``pad_lone_rows`` overrides the load-time measurement.
    ``speculate`` is the speculative decoding mode, ``window`` the most drafts a slot verifies per step.
    """

    supports = frozenset({GRAMMAR, LOGPROBS, TOKEN_PROMPTS})

    def __init__(
        self,
        model: ModelRef | Path,
        *,
        model_id: str | None = None,
        n_ctx: int | None = None,
        n_threads: int | None = None,
        n_gpu_layers: int = 0,
        parallel: int | None = None,
        max_queue: int = 32,
        queue_timeout_s: float = 30.0,
        chat_format: str | None = None,
        default_max_tokens: int = DEFAULT_MAX_TOKENS,
        prefill_chunk: int = PREFILL_CHUNK,
        pad_lone_rows: bool | None = None,
        kernels: Kernels = "exact",
        speculate: SpeculateMode = "auto",
        window: int = WINDOW,
        replay_steps_s: float = REPLAY_STEPS_S,
    ) -> None:
        if parallel is not None and parallel < 1:
            raise EngineError("parallel must be at least 1")
        self.path = model.path if isinstance(model, ModelRef) else Path(model)
        self.model_id = model_id or (model.model_id if isinstance(model, ModelRef) else self.path.stem)
        self._n_ctx = n_ctx
        self.threads = n_threads or default_threads()
        """CPU threads of every llama.cpp context this model opens (its embedder's too)."""
        self._n_gpu_layers = n_gpu_layers
        self._parallel = parallel
        self.max_queue = max_queue
        self.queue_timeout_s = queue_timeout_s
        self._chat_format_override = chat_format
        self.default_max_tokens = default_max_tokens
        self.prefill_chunk = prefill_chunk
        self.pad_lone_rows = pad_lone_rows
        """Whether every call gets at least two rows (measured at load unless set)."""
        self.kernels = kernels
        self.speculate: SpeculateMode = speculate
        """The mode asked for; ``off`` once loaded if windows cannot be verified exactly (``unavailable``)."""
        self.window = max(1, window)
        self.replay_steps_s = replay_steps_s
        """The longest a continuation is predicted to take as decode rows before it is prefilled instead."""
        self.unavailable: str | None = None
        """Why speculation is off although asked for (``None``: it is not, or it was not asked for)."""
        self.spec = SpecStats(speculate)
        self._acceptance = Acceptance()
        """Acceptance over every request: the prior of the next request's window policy."""
        self.stats = EngineStats()
        self.metadata: GGUFMetadata | None = None
        self.chat_format: str = ""
        """``template`` (the GGUF's own) or the llama-cpp-python format name in use."""
        self.parallel = 0
        """Slots, once loaded."""
        self._model: Any = None
        self._ctx: Any = None
        self._render: ChatTemplate | None = None
        self._sched: Scheduler[_Job] | None = None
        self._n_ctx_seq = 0
        self._lock = threading.RLock()
        """Guards the scheduler and the requests' bookkeeping: the loop queues and cancels while a step runs."""
        self._cancels: list[_Job] = []
        self._closed = False
        self._runner: Runner | None = None
        """Where the steps run (made at load)."""
        self._stepping = False
        """A step job is queued or running (at most one: each queues the next while there is work)."""
        self._rate = TokenRate()
        self._mean_request_s = 1.0
        self._costs = CallCosts()

    # ---- lifecycle -------------------------------------------------------------------------

    async def load(self) -> None:
        """Load the weights, size the slots and start the worker (off the event loop)."""
        await asyncio.to_thread(self._load_blocking)

    def _load_blocking(self) -> None:
        from meshllm.engine.llama_native import NativeContext, NativeModel

        meta = read_metadata(self.path)
        model = NativeModel(self.path, n_gpu_layers=self._n_gpu_layers, repack=use_kernels(self.kernels))
        try:
            n_ctx_seq = context_cap(meta.context_length, self._n_ctx)
            parallel = self._parallel or default_parallel(meta, n_ctx_seq)
            if model.recurrent:  # no window, padding row or reused prefix can be taken back out of its state
                self.pad_lone_rows = False
                probe = WindowProbe(False, "the model has recurrent layers, whose state llama.cpp cannot rewind "
                                           "past rejected drafts", {})
            else:
                probe = probe_windows(model, self.threads, self.window + 1, self.pad_lone_rows)
            self.unavailable = probe.differs
            if self.pad_lone_rows is None:
                self.pad_lone_rows = probe.pad_lone_rows
            n_seq = parallel + (1 if self.pad_lone_rows else 0)
            ctx = NativeContext(model, n_seq=n_seq, n_ctx_seq=n_ctx_seq, n_batch=max(self.prefill_chunk, n_seq) + 1,
                                threads=self.threads)
            self._render, self.chat_format = chat_renderer(_TemplateTokens(model), meta.family, meta.chat_template,
                                                           self._chat_format_override)
        except BaseException:
            model.close()
            raise
        self.metadata, self._model, self._ctx = meta, model, ctx
        self._n_ctx_seq = min(n_ctx_seq, ctx.n_ctx_seq)
        self.parallel = parallel
        if self.unavailable is not None and self.speculate != "off":
            # asked for (``on``): say why it is refused; ``auto`` only tried, so only the debug log hears
            log.log(logging.WARNING if self.speculate == "on" else logging.DEBUG,
                    "llama engine %s: no speculation: %s", self.model_id, self.unavailable)
            self.speculate = self.spec.mode = "off"
        for rows, seconds in probe.call_s.items():  # the window pricing starts from the probe's timings
            self._costs.observe(rows, seconds)
        self._sched = Scheduler(parallel, chunk=self.prefill_chunk, max_queue=self.max_queue, reuse=not model.recurrent)
        self._runner = Runner(f"llama-{self.model_id}")

    @property
    def native_tools(self) -> bool:
        return self._render is not None and self._render.knows_tools

    async def close(self) -> None:
        """Refuse new work, end what is running with an error, free the model (after the step in flight)."""
        with self._lock:
            self._closed = True
            runner, self._runner = self._runner, None
        if runner is None:  # never loaded, or closed already
            return
        shutdown = runner.submit("close", self._shutdown, priority=Priority.PREFILL)
        try:
            await runner.aclose()  # (after the step in flight)
        except ComputeTimeout as exc:  # a step outlived the deadline: the model is freed when it ends
            log.warning("llama engine %s: %s", self.model_id, exc)
            return
        shutdown.result()

    def _shutdown(self) -> None:
        """(On the runner.) End every request with an error and free the context and the model."""
        with self._lock:
            if self._sched is not None:
                self._end_all(EngineNotLoaded(f"model {self.model_id} is shutting down"))
        if self._ctx is not None:
            self._ctx.close()
            self._ctx = None
        if self._model is not None:
            self._model.close()
            self._model = None

    @property
    def context_length(self) -> int:
        """Tokens of context each request may use (prompt + completion): one slot's context."""
        if self._model is None:
            raise EngineNotLoaded(f"model {self.model_id} is not loaded")
        return self._n_ctx_seq

    def load_report(self) -> LoadReport:
        """Running/queued counts, slots and recent decode speed."""
        with self._lock:
            running = self._sched.running if self._sched else 0
            queued = self._sched.queued if self._sched else 0
        return LoadReport(running=running, slots=self.parallel or 1, queued=queued, max_queue=self.max_queue,
                          tokens_per_s=round(self._rate.value, 2))

    def speculation_status(self) -> dict[str, object]:
        """Counters, acceptance, the attention kernel the probe chose, the measured call costs, and why
        speculation is off when it was asked for but cannot be exact here (``unavailable``)."""
        costs = {str(n): round(sec * 1e3, 3) for n in (1, 2, self.window + 1)
                 if (sec := self._costs.seconds(n)) is not None}
        return {**self.spec.status(), "acceptance_estimate": round(self._acceptance.rate, 3),
                "max_window": self.window,
                "call_ms_by_rows": costs or None, "unavailable": self.unavailable}

    # ---- prompts ---------------------------------------------------------------------------

    def prompt_tokens(self, request: GenerationRequest) -> list[int]:
        """The exact tokens the engine feeds for ``request`` (what ``usage.prompt_tokens`` counts)."""
        return self._tokenize(request)[0]

    def _tokenize(self, request: GenerationRequest) -> tuple[list[int], tuple[str, ...]]:
        """Prompt tokens, and the stop strings: the client's plus the chat format's end of turn."""
        model = self._require()
        stops = list(request.params.stop)
        if isinstance(request, ChatRequest):
            assert self._render is not None
            try:
                rendered = self._render.render(request)
            except Exception as exc:  # templates raise for conversations they cannot express
                raise BadChat(f"model {self.model_id} cannot render this conversation: {exc}") from exc
            tokens = self._text_tokens(rendered.prompt, add_special=not rendered.added_special, parse_special=True)
            stops += rendered.stop
        elif isinstance(request.prompt, str):
            tokens = self._text_tokens(request.prompt, add_special=True, parse_special=False)
        else:
            tokens = list(request.prompt)
            model.check_tokens(tokens, "the prompt")
        if not tokens:
            raise InvalidRequest("the prompt is empty: this model adds no start token, so give it some text")
        return tokens, tuple(s for s in stops if s)

    def _text_tokens(self, text: str, *, add_special: bool, parse_special: bool) -> list[int]:
        """Tokens of a text prompt, the work bounded by the context (:func:`tokenize_bounded`)."""
        model = self._require()
        return tokenize_bounded(
            lambda b: model.tokenize(b, add_special=add_special, parse_special=parse_special),
            lambda b: len(model.tokenize(b, add_special=False, parse_special=parse_special)),
            text.encode("utf-8"), self._n_ctx_seq, model.longest_token, self.model_id)

    def _prepare(self, request: GenerationRequest) -> _Job:
        """Tokens, text stream and samplers of ``request``, the continuation replayed (a worker thread)."""
        from meshllm.engine.llama_sampling import SlotSampler

        tokens, stops = self._tokenize(request)
        model = self._model
        model.check_tokens(request.continuation, "the continuation")
        limit = token_budget(len(tokens), self._n_ctx_seq, request.params.max_tokens, self.model_id,
                             default=self.default_max_tokens)
        text = TextStream(is_end=model.is_eog, token_bytes=model.piece, stops=stops, limit=limit,
                          prompt_tokens=len(tokens),
                          end_on_repeated_call=request.params.end_on_repeated_call)
        text.replay(request.continuation)
        sampler = None
        if not text.done:
            sampler = SlotSampler(model, request.params)
            try:
                sampler.replay(request.continuation)
            except BaseException:
                sampler.close()
                raise
        client = request.client or (f"user:{request.user}" if request.user else "")
        drafter = policy = None
        if sampler is not None and self.speculate != "off":
            drafter = NgramDrafter([*tokens, *request.continuation])
            policy = WindowPolicy(self.speculate, max_window=self.window, prior=self._acceptance.rate)
        # the continuation as decode rows, as its first engine computed it, unless that would take too long
        forced = request.continuation if self._replay_by_steps(len(request.continuation)) else ()
        return _Job(request=request, prompt_len=len(tokens), target=(*tokens, *request.continuation[len(forced):]),
                    forced=collections.deque(forced), text=text, sampler=sampler, client=client,
                    drafter=drafter, policy=policy)

    def _replay_by_steps(self, tokens: int) -> bool:
        """Whether a continuation of ``tokens`` is decoded one row per step (exact) rather than prefilled
        with the prompt (a multi-row call: exact only where a model's rows agree): while its steps are
        predicted to take at most :attr:`replay_steps_s`, each at the cost of a call as wide as the
        requests running now make it (a step also carries their rows; a lone row its padding row)."""
        with self._lock:
            running = self._sched.running if self._sched else 0
        width = 2 if running == 0 and self.pad_lone_rows else running + 1
        return tokens * self._call_seconds(width) <= self.replay_steps_s

    def _require(self) -> Any:
        if self._model is None or self._closed:
            raise EngineNotLoaded(f"model {self.model_id} is not loaded")
        return self._model

    # ---- generation ------------------------------------------------------------------------

    async def generate(self, request: GenerationRequest) -> AsyncIterator[GenerationEvent]:
        """Queue ``request`` for a slot; stream its events. Closing the iterator cancels it."""
        self._require()
        prepared = asyncio.ensure_future(asyncio.to_thread(self._prepare, request))
        try:
            job = await asyncio.shield(prepared)
        except asyncio.CancelledError:  # the samplers (native memory) are freed once the thread is done
            prepared.add_done_callback(_close_prepared)
            raise
        job.loop = asyncio.get_running_loop()
        if job.text.done:  # the continuation already ended the generation
            for event in job.text.finish():
                yield event
            return
        self._submit(job)
        finished = False
        try:
            while True:
                item = await job.events.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                yield item
                if isinstance(item, Finish):
                    finished = True
                    return
        finally:
            if not finished:
                with self._lock:
                    job.cancelled = True
                    self._cancels.append(job)
                    self._kick()

    def _submit(self, job: _Job) -> None:
        with self._lock:
            if self._closed or self._sched is None:
                job.sampler.close()
                raise EngineNotLoaded(f"model {self.model_id} is shutting down")
            try:
                displaced = self._sched.submit(job, job.target, job.client, time.monotonic())
            except QueueFull as exc:
                self.stats.rejected += 1
                job.sampler.close()
                raise EngineBusy(f"model {self.model_id}: {exc}", retry_after_s=self._retry_after()) from None
            self.stats.requests += 1
            for other in displaced:
                self.stats.rejected += 1
                other.ended = True
                other.sampler.close()
                other.emit(EngineBusy(f"model {self.model_id}: the queue is full and this client holds more "
                                      "than its share", retry_after_s=self._retry_after()))
            self._kick()

    def _retry_after(self) -> float:
        """Seconds until a slot is likely free: the queue ahead, served ``parallel`` at a time."""
        queued = self._sched.queued if self._sched else 0
        return float(min(60.0, max(1.0, self._mean_request_s * (queued + 1) / max(1, self.parallel))))

    # ---- the steps -------------------------------------------------------------------------

    def _kick(self) -> None:
        """(Lock held.) Queue a step on the runner when there is work and none is queued."""
        assert self._sched is not None
        if self._stepping or self._closed or self._runner is None or (not self._cancels and self._sched.idle):
            return
        self._stepping = True
        self._runner.submit("step", self._step).add_done_callback(self._step_ended)

    def _kick_later(self) -> None:
        with self._lock:
            self._kick()

    def _step(self) -> None:
        """(On the runner.) Plan and run one step, then queue the next; every failure reaches the
        requests it concerns."""
        assert self._sched is not None
        with self._lock:
            self._stepping = False
            if self._closed:
                return
            try:
                step = self._next_step()
            except Exception as exc:  # a bug: nothing can be trusted, every request ends with it
                log.exception("llama engine %s: scheduling failed", self.model_id)
                self._end_all(EngineError(f"generation failed: {exc}"))
                return
            if step.empty:  # only waiting requests that expire later: look again shortly
                if not self._sched.idle:
                    threading.Timer(EMPTY_STEP_RETRY_S, self._kick_later).start()
                return
        try:
            self._run(step)
        except Exception as exc:  # a bug or a native failure: fail what the step touched, carry on
            self._fail_step(step, exc)
        with self._lock:
            self._kick()

    def _step_ended(self, done: concurrent.futures.Future[None]) -> None:
        if not done.cancelled() and (exc := done.exception()) is not None:  # a bug in the failure paths
            log.error("llama engine %s: a step failed", self.model_id, exc_info=exc)

    def _next_step(self) -> Step[_Job]:
        """(Lock held.) Cancellations and expired waits first, then the plan."""
        assert self._sched is not None
        self._apply_cancels()
        for job in self._sched.expired(time.monotonic(), self.queue_timeout_s):
            job.ended = True
            job.sampler.close()
            job.emit(EngineBusy(f"model {self.model_id}: request waited over {self.queue_timeout_s:g}s for a slot",
                                retry_after_s=self._retry_after()))
        return self._sched.plan()

    def _apply_cancels(self) -> None:
        """(Lock held.) Free the slots of requests whose consumers went away."""
        assert self._sched is not None
        for job in self._cancels:
            if job.ended:  # it finished before its consumer left
                continue
            job.ended = True
            if self._sched.cancel(job) is not None:
                self._account(job)
            self.stats.cancelled += 1
            job.sampler.close()
        self._cancels.clear()

    def _run(self, step: Step[_Job]) -> None:
        sched, ctx = self._sched, self._ctx
        assert sched is not None
        now = time.monotonic()
        for a in step.assigned:
            ctx.trim(a.slot, a.reused)
            a.job.text.cached_tokens = a.reused
            a.job.started = now
            self.stats.cached_tokens += a.reused
        if step.decode:
            self._decode(step.decode)
        for chunk in step.prefill:
            self._prefill(chunk)

    def _decode(self, rows: list[DecodeRow]) -> None:
        """Every generating slot's next token, with the windows of the slots that speculate, in one call.

        llama.cpp puts only consecutive sequences in one batch, so a free or prefilling slot between two
        generating ones gets a padding row (its next position, removed after the call): a row costs far
        less than a second pass over the weights. Where one-row calls are measured to be faster than
        the batch (:class:`~meshllm.engine.slots.CallCosts`), the rows go one by one instead (never with
        windows); with row-exact kernels that changes no result (with padding on, a lone row would,
        so never then).
        """
        drafts = self._drafts(rows)
        if not drafts and not self.pad_lone_rows and self._costs.split(len(rows)):
            for row in rows:
                self._decode_segment([row], drafts)
            return
        for segment in self._segments(rows):
            self._decode_segment(segment, drafts)

    def _drafts(self, rows: list[DecodeRow]) -> dict[int, list[int]]:
        """The drafts each speculating slot verifies in this step (slot -> tokens after its row's).

        Slot by slot, a window is priced against the call as it stands (its rows so far, the tokens the
        other slots are expected to yield) at the measured cost of a call by row count
        (:func:`~meshllm.engine.speculate.batch_cost`); a slot whose draft is not worth it judges the
        draft against its plain tokens instead (``WindowPolicy.decline``).
        """
        drafts: dict[int, list[int]] = {}
        if self.speculate == "off":
            return drafts
        assert self._sched is not None
        slots = [r.slot for r in rows]
        width = max(slots) - min(slots) + 1  # the call's rows: the slots' and the gaps' padding rows
        others = float(len(rows))  # tokens the step is expected to yield (one a slot, more with a window)
        for row in rows:
            job = self._sched.slots[row.slot].job
            if job is None or job.drafter is None or job.policy is None or job.forced or job.cancelled:
                continue
            # a window yields up to k + 1 tokens, its last position must fit the context, its rows the
            # batch (less one for a lone row's extra pad)
            room = min(job.text.remaining - 1, self._n_ctx_seq - 1 - row.pos, self._ctx.n_batch - width - 1)
            found = job.drafter.draft(min(room, self.window)) if room > 0 else []
            if not found:
                continue
            # without any window yet, the plain step may run its rows one call each where that is faster
            plain = None if drafts or self.pad_lone_rows else min(self._call_seconds(width),
                                                                  len(rows) * self._call_seconds(1))
            k = job.policy.window(len(found), batch_cost(self._call_seconds, width, others - 1.0, plain))
            if k:
                drafts[row.slot] = found[:k]
                width += k
                others += expected_tokens(job.policy.acceptance.rate, k) - 1.0
            else:
                job.policy.decline(found)
        return drafts

    def _call_seconds(self, rows: int) -> float:
        """Expected seconds of a decode call of ``rows`` rows (:meth:`CallCosts.seconds`; the probe measured two)."""
        seconds = self._costs.seconds(rows)
        return float("inf") if seconds is None else seconds

    def _segments(self, rows: list[DecodeRow]) -> Iterator[list[DecodeRow | tuple[int, int, int]]]:
        """Rows and gap pads ``(token, pos, seq)`` covering consecutive sequences; a gap that cannot be
        padded (its sequence is full) splits the call."""
        by_slot = {r.slot: r for r in rows}
        segment: list[DecodeRow | tuple[int, int, int]] = []
        for seq in range(min(by_slot), max(by_slot) + 1):
            row = by_slot.get(seq)
            pad = None if row is not None else self._pad_row(seq, rows[0].token)
            if row is None and pad is None:
                if segment:
                    yield segment
                segment = []
                continue
            segment.append(row if row is not None else pad)  # type: ignore[arg-type]
        if segment:
            yield segment

    def _decode_segment(self, segment: list[DecodeRow | tuple[int, int, int]], drafts: dict[int, list[int]]) -> None:
        """One call: each row's token and its drafts (logits for all), pads between (none kept)."""
        real = [e for e in segment if isinstance(e, DecodeRow)]
        if not real:
            return
        tokens: list[int] = []
        pos: list[int] = []
        seqs: list[int] = []
        outputs: list[bool] = []
        pads: list[tuple[int, int, int]] = []
        first: dict[int, int] = {}  # slot -> batch index of its row (its drafts follow)
        for e in segment:
            if isinstance(e, DecodeRow):
                window = [e.token, *drafts.get(e.slot, ())]
                first[e.slot] = len(tokens)
                tokens += window
                pos += range(e.pos, e.pos + len(window))
                seqs += [e.slot] * len(window)
                outputs += [self._needs_logits(e.slot), *[True] * (len(window) - 1)]
            else:
                pads.append(e)
                tokens.append(e[0])
                pos.append(e[1])
                seqs.append(e[2])
                outputs.append(False)
        if self.pad_lone_rows and sum(outputs) == 1:  # a second output row, so the lone row computes as in a batch
            if pads:
                outputs[seqs.index(pads[0][2])] = True
            elif (extra := self._pad_row(seqs[-1] + 1, tokens[-1])) is not None:
                pads.append(extra)
                tokens, pos, seqs, outputs = [*tokens, extra[0]], [*pos, extra[1]], [*seqs, extra[2]], [*outputs, True]
        started = time.perf_counter()
        try:
            self._ctx.decode(tokens, pos, seqs, outputs)
        finally:
            for _token, at, seq in pads:
                self._ctx.trim(seq, at)
        self._costs.observe(len(tokens), time.perf_counter() - started)
        self.stats.decode_calls += 1
        self.stats.decode_rows += len(real)
        for row in real:
            draft = drafts.get(row.slot, [])
            if not outputs[first[row.slot]]:
                self.stats.headless_rows += 1
                self._after_logits(row.slot, [], row)
                continue
            logits = [self._ctx.logits(first[row.slot] + i) for i in range(len(draft) + 1)]
            self._after_logits(row.slot, logits, row, draft)

    def _needs_logits(self, index: int) -> bool:
        """Whether slot ``index``'s decode row needs its logits: not while it replays a continuation
        (the next token is known, and a forced slot never drafts), unless padding is on (there the
        number of output rows changes the head's kernel for the others). The KV of a row is the same
        either way: llama.cpp drops non-output rows only after the last layer's attention. On the
        default model the 262k-row head is over half of a decode step."""
        assert self._sched is not None
        job = self._sched.slots[index].job
        return self.pad_lone_rows or job is None or not job.forced

    def _prefill(self, chunk: Chunk) -> None:
        """One grid chunk of a prompt; its last chunk gives the first token."""
        n = len(chunk.tokens)
        tokens, pos, seqs = list(chunk.tokens), list(range(chunk.start, chunk.start + n)), [chunk.slot] * n
        outputs = [False] * n
        pad = None
        if chunk.last:
            outputs[-1] = True
            if self.pad_lone_rows:
                if n >= 2:
                    outputs[-2] = True
                else:
                    pad = self._pad_row(chunk.slot + 1, chunk.tokens[-1])
        if pad is not None:
            tokens, pos, seqs, outputs = [*tokens, pad[0]], [*pos, pad[1]], [*seqs, pad[2]], [*outputs, True]
        try:
            self._ctx.decode(tokens, pos, seqs, outputs)
        finally:
            if pad is not None:
                self._ctx.trim(pad[2], pad[1])
        self.stats.prefill_chunks += 1
        assert self._sched is not None
        with self._lock:
            self._sched.prefilled(chunk)
        if chunk.last:
            self._after_logits(chunk.slot, [self._ctx.logits(n - 1)])

    def _pad_row(self, seq: int, token: int) -> tuple[int, int, int] | None:
        """A throwaway row ``(token, pos, seq)`` at sequence ``seq``'s next position (the caller removes it
        after the call); ``None`` when that sequence does not exist or is full."""
        if seq >= self._ctx.n_seq or self._model.recurrent:  # a row folded into a recurrent state stays there
            return None
        at = self._ctx.length(seq)
        return (token, at, seq) if at < self._ctx.n_ctx_seq else None

    def _after_logits(self, index: int, logits: list[np.ndarray], row: DecodeRow | None = None,
                      draft: Sequence[int] = ()) -> None:
        """Sample the slot's next tokens, send their text, and continue or finish the request.

        ``logits`` are the rows of the slot's last call: one (a prefill's last chunk, or the decode
        ``row``) or a window, ``row`` then ``draft``; none for a continuation's row
        (:meth:`_needs_logits`). A window keeps what :func:`~meshllm.engine.speculate.verify_window`
        keeps, and its other positions leave the KV.
        """
        assert self._sched is not None
        job = self._sched.slots[index].job
        if job is None or job.cancelled:
            if row is not None:
                if draft:
                    self._ctx.trim(index, row.pos + 1)
                with self._lock:
                    self._sched.decoded(index)
            return
        if job.forced:  # a continuation token: decoded as the first engine decoded it, not sampled
            with self._lock:
                if row is not None:
                    self._sched.decoded(index)
                self._sched.sampled(index, job.forced.popleft())
            return
        fed = 0

        def produce(i: int) -> int | None:
            nonlocal fed
            token = job.sampler.sample(logits[i], job.text.generated)
            if token is None:  # the grammar allows nothing more: the text is complete
                job.text.reason, job.text.done = "stop", True
                return None
            fed += 1
            delta = job.text.feed(token, logprob=job.sampler.logprob(logits[i], token))
            if delta is not None:
                job.emit(delta)
            if job.text.done:
                return None
            job.sampler.accept(token)
            return token

        try:
            out = verify_window(draft, produce)
            # drafts kept, whose KV stays: all a text that ended produced, else all but the model's own last
            kept = len(out) if job.text.done else len(out) - 1
            if row is not None and draft:
                self._ctx.trim(index, row.pos + 1 + kept)
                if not job.text.done:
                    job.policy.observe(len(draft), kept)
                    self._acceptance.observe(len(draft), kept)
            elif job.policy is not None:
                job.policy.produced(out)
            if job.drafter is not None:
                job.drafter.extend(out)
            if row is not None:  # a decode pass (a prefill's first token is not one)
                self.spec.observe(len(draft), kept, fed)
            with self._lock:
                if row is not None:
                    self._sched.decoded(index, out[:kept])
                if not job.text.done:
                    self._sched.sampled(index, out[-1])
                    return
            for event in job.text.finish():
                job.emit(event)
            with self._lock:
                self.stats.completed += 1
                self._end(job, index)
        except Exception as exc:
            job.emit(exc if isinstance(exc, EngineError) else EngineError(f"generation failed: {exc}"))
            with self._lock:
                self._end(job, index)

    def _end(self, job: _Job, index: int) -> None:
        """(Lock held.) The request left its slot."""
        assert self._sched is not None
        self._sched.release(index)
        job.ended = True
        self._account(job)
        job.sampler.close()

    def _account(self, job: _Job) -> None:
        now = time.monotonic()
        self.stats.prompt_tokens += job.prompt_len
        self.stats.completion_tokens += job.text.generated - len(job.request.continuation)
        if job.started:
            self._rate.observe(job.text.generated, job.started, now)
            self._mean_request_s = 0.7 * self._mean_request_s + 0.3 * (now - job.started)

    def _fail_step(self, step: Step[_Job], exc: Exception) -> None:
        """A call failed: its requests get the error, their slots start empty."""
        error = exc if isinstance(exc, EngineError) else EngineError(f"generation failed: {exc}")
        assert self._sched is not None
        touched = {a.slot for a in step.assigned} | {r.slot for r in step.decode} | {c.slot for c in step.prefill}
        with self._lock:
            for index in sorted(touched):
                job = self._sched.slots[index].job
                self._sched.forget(index)
                with contextlib.suppress(EngineError):
                    self._ctx.trim(index, 0)
                if job is not None:
                    job.emit(error)
                    self._end(job, index)

    def _end_all(self, error: EngineError) -> None:
        """(Lock held.) Every request queued or running ends with ``error``; no cache is trusted."""
        assert self._sched is not None
        for slot in self._sched.slots:
            if slot.job is not None:
                slot.job.emit(error)
                self._end(slot.job, slot.index)
            self._sched.forget(slot.index)
            with contextlib.suppress(EngineError):
                if self._ctx is not None:
                    self._ctx.trim(slot.index, 0)
        for job in self._sched.expired(float("inf"), -1.0):
            job.ended = True
            job.sampler.close()
            job.emit(error)


class _TemplateTokens:
    """What :func:`~meshllm.engine.chat_format.chat_renderer` reads from a ``llama_cpp.Llama`` to render a
    GGUF's own template (BOS/EOS ids and their text), served by the native model."""

    def __init__(self, model: Any) -> None:
        self._model = self  # chat_renderer reads llama._model.token_get_text
        self._native = model

    def token_get_text(self, token: int) -> str:
        return str(self._native.token_text(token))

    def token_bos(self) -> int:
        return int(self._native.bos)

    def token_eos(self) -> int:
        return int(self._native.eos)


def _close_prepared(prepared: asyncio.Future[_Job]) -> None:
    """Free the samplers of a job whose request was cancelled while it was being prepared."""
    if not prepared.cancelled() and prepared.exception() is None and prepared.result().sampler is not None:
        prepared.result().sampler.close()


def _probe_tokens(model: Any, n: int, salt: int = 0) -> list[int]:
    """``n`` fixed token ids spread over the vocabulary (the start token first), for the load-time probes."""
    return [model.bos if model.bos >= 0 else 0] + [((k + salt) * 7919) % model.n_vocab for k in range(1, n)]


def lone_row_differs(model: Any, threads: int) -> bool:
    """Whether llama.cpp computes a batch of one row differently from the same row beside another.

    A small probe context decodes the same token at the same position twice, once alone and once
    with a second row in another sequence, and compares the logits bit for bit.
    """
    from meshllm.engine.llama_native import NativeContext

    ctx = NativeContext(model, n_seq=2, n_ctx_seq=256, n_batch=8, threads=threads)
    try:
        probe = _probe_tokens(model, 5)
        ctx.decode(probe[:4], [0, 1, 2, 3], [0] * 4, [False, False, False, True])
        ctx.decode(probe[4:], [4], [0], [True])
        alone = ctx.logits(0).copy()
        ctx.trim(0, 4)
        ctx.decode([probe[4], probe[4]], [4, 0], [0, 1], [True, True])
        return not np.array_equal(alone, ctx.logits(0))
    finally:
        ctx.close()


@dataclass(frozen=True)
class WindowProbe:
    """What :func:`probe_windows` measured."""

    pad_lone_rows: bool
    """Whether a lone row computes differently from a pair (:func:`lone_row_differs`)."""
    differs: str | None
    """Why no kernel computes windows exactly (``None``: one does)."""
    call_s: dict[int, float]
    """Seconds of the probe's calls by row count (single rows, windows beside a row)."""


PROBE_PROMPT = 16
"""Tokens in the KV before the probe's windows."""


def probe_windows(model: Any, threads: int, rows: int, pad_lone_rows: bool | None = None) -> WindowProbe:
    """Whether llama.cpp computes a window (several consecutive positions of one sequence in one call)
    exactly as it computes the same positions one call at a time.

    Speculation is only invisible if it is: a kept draft's logits and KV must be those of plain
    decoding. On this CPU build quantized weights compute rows alike in any batch (integer dot
    products), but softmax attention over several query rows of a sequence takes another kernel
    (tinyBLAS over f16 keys) when heads share keys (flash attention would run each query row alone,
    but its sums differ from softmax attention's, which the ggml stage runtime computes as llama.cpp
    does by default: the node keeps softmax attention so split chains and ``--engine ggml`` give its
    text);
    float32 or float16 weights go through tinyBLAS from two rows, whose sums depend on the row count.
    So the probe decodes ``rows`` positions one by one as the engine's plain steps would (alone, or
    beside a padding row where a lone row differs: ``pad_lone_rows``, measured unless given), then
    windows of 2, 3 and ``rows`` positions beside a row of another sequence, and compares the
    logits bit for bit. The calls' durations seed the engine's
    call costs either way (a first call of a shape includes llama.cpp's graph set-up: an overestimate,
    which keeps ``auto`` from drafting on a guess; a replay prices its decode rows with them).
    """
    from meshllm.engine.llama_native import NativeContext

    call_s: dict[int, float] = {}
    prompt, window = _probe_tokens(model, PROBE_PROMPT), _probe_tokens(model, rows + 1, salt=31)[1:]
    pad = lone_row_differs(model, threads) if pad_lone_rows is None else pad_lone_rows
    ctx = NativeContext(model, n_seq=3, n_ctx_seq=256, n_batch=max(PROBE_PROMPT, rows + 1), threads=threads)
    try:
        for seq in (0, 1):
            ctx.decode(prompt, list(range(PROBE_PROMPT)), [seq] * PROBE_PROMPT,
                       [i == PROBE_PROMPT - 1 for i in range(PROBE_PROMPT)])
        singles: list[np.ndarray] = []
        single_s: list[float] = []
        for i, token in enumerate(window):
            started = time.perf_counter()
            if pad:
                ctx.decode([token, token], [PROBE_PROMPT + i, 0], [0, 2], [True, True])
            else:
                ctx.decode([token], [PROBE_PROMPT + i], [0], [True])
            single_s.append(time.perf_counter() - started)
            singles.append(ctx.logits(0).copy())
            ctx.trim(2, 0)
        exact = True
        for n in sorted({2, 3, rows}):
            ctx.trim(1, PROBE_PROMPT)
            started = time.perf_counter()
            ctx.decode([window[0], *window[:n]], [PROBE_PROMPT + rows, *range(PROBE_PROMPT, PROBE_PROMPT + n)],
                       [0] + [1] * n, [True] * (n + 1))
            call_s[n + 1] = time.perf_counter() - started
            ctx.trim(0, PROBE_PROMPT + rows)
            exact = exact and all(np.array_equal(ctx.logits(1 + i), singles[i]) for i in range(n))
        call_s[2 if pad else 1] = statistics.median(single_s)
    finally:
        ctx.close()
    if exact:
        return WindowProbe(pad, None, call_s)
    return WindowProbe(pad, "llama.cpp computes a window of positions differently from the same positions one at a "
                            "time with this model (float weights, --kernels fast, or softmax attention over keys "
                            "that heads share), so drafts could change the text", call_s)


def kv_bytes_per_token(meta: GGUFMetadata) -> int:
    """KV cache bytes one token of one sequence takes (f16 keys and values, every layer)."""
    arch, f = meta.architecture, meta.fields
    heads = f.get(f"{arch}.attention.head_count")
    heads = heads if isinstance(heads, int) and heads > 0 else 1
    kv_heads = f.get(f"{arch}.attention.head_count_kv", heads)
    kv_heads = heads if isinstance(kv_heads, ArrayInfo) or not isinstance(kv_heads, int) else kv_heads
    width = max(1, meta.embedding_length)
    k_len = f.get(f"{arch}.attention.key_length", width // heads)
    v_len = f.get(f"{arch}.attention.value_length", width // heads)
    return max(1, meta.block_count) * kv_heads * (int(k_len) + int(v_len)) * 2


def available_ram_bytes() -> int:
    """Memory available to new allocations now (``MemAvailable``), else the machine's total."""
    with contextlib.suppress(OSError, ValueError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return total_ram_bytes()


def default_parallel(meta: GGUFMetadata, n_ctx_seq: int) -> int:
    """Slots when ``--parallel`` is not given: as many full-context KV caches as a quarter of the free
    memory holds, at most :data:`MAX_DEFAULT_PARALLEL`."""
    per_slot = kv_bytes_per_token(meta) * n_ctx_seq
    return int(max(1, min(MAX_DEFAULT_PARALLEL, available_ram_bytes() * KV_MEMORY_SHARE // per_slot)))
