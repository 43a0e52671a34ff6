"""NumpyEngine: the whole model as one numpy stage, behind the shared :class:`Engine` interface.

It exists so a node without a working llama.cpp build can still serve (``meshllm serve --engine
numpy``), and so the split runtime is exercised end to end through the same API as llama.cpp. Each
forward step (and the sampling after it) runs in a worker thread via ``asyncio.to_thread``; the event
loop only moves tokens. Requests take turns on one lock (numpy already uses every core for one
request); a consumer that stops iterating cancels its request before the next token.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import numpy as np

from meshllm.engine.base import (
    Engine,
    EngineBusy,
    EngineNotLoaded,
    GenerationEvent,
    GenerationParams,
    GenerationRequest,
    LoadReport,
    TokenRate,
    context_cap,
)
from meshllm.engine.numpy.sampler import Sampler, SamplingParams
from meshllm.engine.numpy.stage import StageModel
from meshllm.engine.numpy.tokenizer import Tokenizer
from meshllm.engine.text import TextStream, token_budget
from meshllm.models.metadata import read_metadata
from meshllm.models.refs import ModelRef


def sampling_params(params: GenerationParams) -> SamplingParams:
    """OpenAI semantics for the numpy sampler: no min-p and no repetition penalty unless asked."""
    return SamplingParams(
        temperature=params.temperature,
        top_k=params.top_k or 0,
        top_p=params.top_p,
        presence_penalty=params.presence_penalty,
        frequency_penalty=params.frequency_penalty,
        seed=params.seed,
    )


class NumpyEngine(Engine):
    """Serve one GGUF with the numpy stage runtime (layers [0, n) in one stage)."""

    def __init__(
        self,
        model: ModelRef | Path,
        *,
        model_id: str | None = None,
        n_ctx: int | None = None,
        max_queue: int = 32,
        queue_timeout_s: float = 120.0,
    ) -> None:
        self.path = model.path if isinstance(model, ModelRef) else Path(model)
        self.model_id = model_id or (model.model_id if isinstance(model, ModelRef) else self.path.stem)
        self._n_ctx = n_ctx
        self.max_queue = max_queue
        self.queue_timeout_s = queue_timeout_s
        self.stage: StageModel | None = None
        self.tokenizer: Tokenizer | None = None
        self._turn = asyncio.Lock()
        self._queued = 0
        self._running = 0
        self._rate = TokenRate()

    async def load(self) -> None:
        """Dequantize the model and load its tokenizer, off the event loop."""
        self.stage, self.tokenizer = await asyncio.to_thread(self._load_blocking)

    def _load_blocking(self) -> tuple[StageModel, Tokenizer]:
        meta = read_metadata(self.path)
        stage = StageModel.load(self.path, max_context=context_cap(meta.context_length, self._n_ctx))
        return stage, Tokenizer(self.path, meta.architecture, meta.chat_template)

    async def close(self) -> None:
        """Free the model; a request in flight fails at its next token with :class:`EngineNotLoaded`."""
        if self.tokenizer is not None:
            self.tokenizer.close()
        self.stage = self.tokenizer = None

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
        return self._require()[1].request_prompt(request, self.model_id)

    async def generate(self, request: GenerationRequest) -> AsyncIterator[GenerationEvent]:
        """Wait for a turn, then stream ``request``'s text and one :class:`Finish`."""
        self._require()
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
        prompt, stop_strings = await asyncio.to_thread(self.prompt_tokens, request)
        limit = token_budget(len(prompt), stage.max_context, request.params.max_tokens, self.model_id)
        sampler = Sampler(sampling_params(request.params))
        text = TextStream(is_end=tokenizer.is_end, token_bytes=tokenizer.token_bytes, stops=stop_strings,
                          limit=limit, prompt_tokens=len(prompt))
        session = uuid.uuid4().hex
        history = list(prompt)
        started = time.monotonic()
        step: asyncio.Future[int] = asyncio.ensure_future(asyncio.to_thread(self._step, session, history, 0, sampler))
        try:
            token = await step
            while True:
                delta = text.feed(token)
                if delta is not None:
                    yield delta
                if text.done:
                    break
                history.append(token)
                step = asyncio.ensure_future(
                    asyncio.to_thread(self._step, session, history, len(history) - 1, sampler))
                token = await step
        finally:
            # A cancelled request's forward pass still runs in its thread: let it end before the
            # session's KV cache is freed and the next request takes the turn.
            if not step.done():
                with contextlib.suppress(BaseException):
                    await asyncio.shield(step)
            stage.reset(session)
            self._rate.observe(text.generated, started, time.monotonic())
        for event in text.finish():
            yield event

    def _step(self, session: str, history: list[int], pos: int, sampler: Sampler) -> int:
        """Worker thread: feed ``history[pos:]`` and sample the next token."""
        stage = self._require()[0]
        logits = stage.forward(session, np.asarray(history[pos:], dtype=np.int64), pos, last_only=True)
        return sampler(logits[-1], history)

