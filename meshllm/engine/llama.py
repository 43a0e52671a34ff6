"""LlamaEngine: one llama-cpp-python model, one worker thread, a bounded queue of requests.

A llama.cpp context is not safe to share between threads and holds one KV cache, so each engine
runs requests one at a time on its own thread; the rest wait in a queue whose depth is the load
the node reports. The event loop never blocks: tokens cross from the worker to the loop with
``call_soon_threadsafe``.

We drive ``Llama.generate`` token by token rather than calling ``create_completion`` because we
need three things it does not give a stream: exact usage counts (its stream has none), a check
between every two tokens for a consumer that went away, and stop strings that never leak a
partial match to the client.

Chat prompts come from the GGUF's own template when it has one; otherwise from the family's
known format (the default Gemma 3 270M has no template, and llama-cpp-python's generic fallback
makes it answer with nothing).
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from meshllm.engine.base import (
    BadChat,
    ChatRequest,
    Engine,
    EngineBusy,
    EngineError,
    EngineNotLoaded,
    Finish,
    GenerationEvent,
    GenerationParams,
    GenerationRequest,
    LoadReport,
    TokenRate,
    context_cap,
)
from meshllm.engine.chat_format import chat_renderer
from meshllm.engine.text import TextStream, token_budget
from meshllm.models.metadata import GGUFMetadata, read_metadata
from meshllm.models.refs import ModelRef


@dataclass
class EngineStats:
    """Lifetime counters; tests and the status page read them."""

    requests: int = 0
    completed: int = 0
    cancelled: int = 0
    rejected: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0


@dataclass(eq=False)
class _Job:
    """One request on its way through the queue and the worker."""

    request: GenerationRequest
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue[GenerationEvent | BaseException]
    enqueued: float
    cancel: threading.Event = field(default_factory=threading.Event)

    def emit(self, item: GenerationEvent | BaseException) -> None:
        """Hand an event to the consumer's loop (called on the worker thread)."""
        self.loop.call_soon_threadsafe(self.events.put_nowait, item)


class LlamaEngine(Engine):
    """Serve one GGUF with llama-cpp-python.

    ``n_ctx`` defaults to the model's trained context capped at ``DEFAULT_MAX_CONTEXT``.
    ``max_queue`` bounds waiting requests; ``queue_timeout_s`` bounds how long one may wait.
    """

    def __init__(
        self,
        model: ModelRef | Path,
        *,
        model_id: str | None = None,
        n_ctx: int | None = None,
        n_threads: int | None = None,
        n_gpu_layers: int = 0,
        max_queue: int = 32,
        queue_timeout_s: float = 120.0,
        chat_format: str | None = None,
    ) -> None:
        self.path = model.path if isinstance(model, ModelRef) else Path(model)
        self.model_id = model_id or (model.model_id if isinstance(model, ModelRef) else self.path.stem)
        self._n_ctx = n_ctx
        self._n_threads = n_threads
        self._n_gpu_layers = n_gpu_layers
        self.max_queue = max_queue
        self.queue_timeout_s = queue_timeout_s
        self._chat_format_override = chat_format
        self.stats = EngineStats()
        self.metadata: GGUFMetadata | None = None
        self.chat_format: str = ""
        """``template`` (the GGUF's own) or the llama-cpp-python format name in use."""
        self._llama: Any = None
        self._render: Callable[..., Any] | None = None
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"llama-{self.model_id}")
        self._lock = threading.Lock()
        self._queued = 0
        self._running = 0
        self._rate = TokenRate()
        self._closed = False
        self._jobs: set[_Job] = set()

    # ---- lifecycle -------------------------------------------------------------------------

    async def load(self) -> None:
        """Read metadata and load the weights on the worker thread."""
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(self._executor, self._load_blocking)

    def _load_blocking(self) -> None:
        try:
            from llama_cpp import Llama
        except ImportError as exc:
            raise EngineError("llama-cpp-python is not installed",
                              hint="install meshllm with its dependencies (see install.sh)") from exc
        meta = read_metadata(self.path)
        n_ctx = context_cap(meta.context_length, self._n_ctx)
        threads = self._n_threads or max(1, min(8, os.cpu_count() or 1))
        try:
            llama = Llama(model_path=str(self.path), n_ctx=n_ctx, n_threads=threads,
                          n_gpu_layers=self._n_gpu_layers, verbose=False)
        except (ValueError, RuntimeError, OSError) as exc:
            raise EngineError(f"llama.cpp could not load {self.path}: {exc}",
                              hint="check that the file is a complete GGUF this llama.cpp supports") from exc
        self.metadata = meta
        self._llama = llama
        self._render, self.chat_format = chat_renderer(llama, meta.family, meta.chat_template,
                                                       self._chat_format_override)

    async def close(self) -> None:
        """Refuse new work, let the worker finish its current token, free the model."""
        self._closed = True
        for job in list(self._jobs):
            job.cancel.set()
            job.emit(EngineNotLoaded(f"model {self.model_id} is shutting down"))
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, self._executor.shutdown)
        if self._llama is not None:
            self._llama.close()
            self._llama = None

    @property
    def context_length(self) -> int:
        """The context allocated per request (prompt + completion)."""
        if self._llama is None:
            raise EngineNotLoaded(f"model {self.model_id} is not loaded")
        return int(self._llama.n_ctx())

    def load_report(self) -> LoadReport:
        """Running/queued counts and recent decode speed."""
        with self._lock:
            return LoadReport(running=self._running, queued=self._queued, max_queue=self.max_queue,
                              tokens_per_s=round(self._rate.value, 2))

    # ---- prompts ---------------------------------------------------------------------------

    def prompt_tokens(self, request: GenerationRequest) -> list[int]:
        """The exact tokens the engine feeds for ``request`` (what ``usage.prompt_tokens`` counts)."""
        return self._prepare(request)[0]

    def _prepare(self, request: GenerationRequest) -> tuple[list[int], tuple[str, ...]]:
        """Prompt tokens, and the stop strings: the client's plus the chat format's end of turn."""
        llama = self._require()
        stops = list(request.params.stop)
        if isinstance(request, ChatRequest):
            assert self._render is not None
            messages = [{"role": m.role, "content": m.content} for m in request.messages]
            try:
                rendered = self._render(messages=messages, tools=list(request.tools) or None)
            except Exception as exc:  # templates raise for conversations they cannot express
                raise BadChat(f"model {self.model_id} cannot render this conversation: {exc}") from exc
            tokens = llama.tokenize(rendered.prompt.encode("utf-8"), add_bos=not rendered.added_special,
                                    special=True)
            extra = rendered.stop
            stops += [extra] if isinstance(extra, str) else list(extra or [])
        else:
            tokens = llama.tokenize(request.prompt.encode("utf-8"), add_bos=True, special=False)
        return list(tokens), tuple(s for s in stops if s)

    def _require(self) -> Any:
        if self._llama is None or self._closed:
            raise EngineNotLoaded(f"model {self.model_id} is not loaded")
        return self._llama

    # ---- generation ------------------------------------------------------------------------

    async def generate(self, request: GenerationRequest) -> AsyncIterator[GenerationEvent]:
        """Queue ``request``; stream its events. Closing the iterator cancels it."""
        self._require()
        with self._lock:
            if self._queued >= self.max_queue:
                self.stats.rejected += 1
                raise EngineBusy(f"model {self.model_id} has {self._queued} requests queued (limit {self.max_queue})")
            self._queued += 1
            self.stats.requests += 1
        loop = asyncio.get_running_loop()
        job = _Job(request=request, loop=loop, events=asyncio.Queue(), enqueued=time.monotonic())
        try:
            loop.run_in_executor(self._executor, self._run, job)
        except RuntimeError as exc:  # executor shut down by close()
            with self._lock:
                self._queued -= 1
            raise EngineNotLoaded(f"model {self.model_id} is shutting down") from exc
        finished = False
        self._jobs.add(job)
        try:
            while True:
                item = await job.events.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if isinstance(item, Finish):
                    finished = True
                    return
        finally:
            self._jobs.discard(job)
            if not finished:
                job.cancel.set()

    def _run(self, job: _Job) -> None:
        """Worker thread: run one job to its end, reporting every outcome as an event."""
        with self._lock:
            self._queued -= 1
            self._running += 1
        try:
            if job.cancel.is_set():
                self._count_cancel()
                return
            waited = time.monotonic() - job.enqueued
            if waited > self.queue_timeout_s:
                job.emit(EngineBusy(f"model {self.model_id}: request waited {waited:.1f}s in the queue"))
                return
            self._generate_blocking(job)
        except Exception as exc:  # every failure reaches the consumer, never a silent thread death
            job.emit(exc if isinstance(exc, EngineError) else EngineError(f"generation failed: {exc}"))
        finally:
            with self._lock:
                self._running -= 1

    def _count_cancel(self) -> None:
        with self._lock:
            self.stats.cancelled += 1

    def _generate_blocking(self, job: _Job) -> None:
        llama = self._require()
        request, params = job.request, job.request.params
        prompt, stop_strings = self._prepare(request)
        limit = token_budget(len(prompt), int(llama.n_ctx()), params.max_tokens, self.model_id)
        llama.set_seed(_seed(params))
        text = TextStream(is_end=_eog_check(llama), token_bytes=lambda token: llama.detokenize([token]),
                          stops=stop_strings, limit=limit, prompt_tokens=len(prompt))
        started = time.monotonic()
        for token in llama.generate(prompt, reset=True, **_sampling(params)):
            if job.cancel.is_set():
                self._count_cancel()
                self._account(len(prompt), text.generated, started)
                return
            delta = text.feed(token)
            if delta is not None:
                job.emit(delta)
            if text.done:
                break
        self._account(len(prompt), text.generated, started)
        with self._lock:
            self.stats.completed += 1
        for event in text.finish():
            job.emit(event)

    def _account(self, prompt_tokens: int, generated: int, started: float) -> None:
        with self._lock:
            self.stats.prompt_tokens += prompt_tokens
            self.stats.completion_tokens += generated
            self._rate.observe(generated, started, time.monotonic())


def _sampling(params: GenerationParams) -> dict[str, Any]:
    """``Llama.generate`` keyword arguments: OpenAI semantics (no min-p, no repeat penalty)."""
    return {
        "temp": params.temperature,
        "top_p": params.top_p,
        "top_k": params.top_k or 0,
        "min_p": 0.0,
        "typical_p": 1.0,
        "repeat_penalty": 1.0,
        "presence_penalty": params.presence_penalty,
        "frequency_penalty": params.frequency_penalty,
    }


def _seed(params: GenerationParams) -> int:
    """llama.cpp seeds are u32; without a client seed, a fresh random one per request."""
    if params.seed is None:
        return int.from_bytes(os.urandom(4), "little")
    return params.seed % (1 << 32)


def _eog_check(llama: Any) -> Callable[[int], bool]:
    """A predicate for end-of-generation tokens (EOS, EOT and the model's other end markers)."""
    import llama_cpp

    vocab = llama._model.vocab
    return lambda token: bool(llama_cpp.llama_vocab_is_eog(vocab, token))
