"""Embeddings: pooled hidden states of a served model, through a second llama.cpp context.

A generation context computes logits, not pooled states, and holds the slots of running
requests; embeddings need ``embeddings=True`` and a batch that holds a whole input (pooling is
over all of its tokens). So a llama.cpp model that is asked to embed loads a second context over
the same GGUF (the weights are memory-mapped, so the pages are shared) on the first embeddings
request, with its own compute runner (:class:`~meshllm.compute.Runner`), and keeps it. Pooling
is the model's own when its GGUF declares one (an embedding model), else the mean over the input's
tokens; vectors are L2-normalised, as OpenAI's are.

:func:`embed` is the one entry point; engines other than llama.cpp (the numpy runtime, split
chains) cannot embed, which is a 400 naming ``model``.
"""

from __future__ import annotations

import contextlib
import math
import weakref
from array import array
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from meshllm.compute import Priority, Runner, RunnerClosed
from meshllm.engine.base import Embeddings, EmbedRequest, Engine, EngineError, PromptTooLong, Unsupported

MAX_INPUTS = 128
"""Inputs one request may embed (the answer must fit one tunnel frame)."""


class LlamaEmbedder:
    """A llama.cpp context with embeddings enabled over one GGUF, loaded on first use."""

    def __init__(self, path: Path, model_id: str, *, context: int, pooling: int | None,
                 threads: int) -> None:
        self.path = path
        self.model_id = model_id
        self.context = context
        self._pooling = pooling
        self._threads = threads
        self._llama: Any = None
        """The context, touched only on the runner's thread."""
        self._runner = Runner(f"embed-{model_id}")
        self._used = False
        """A request was queued (so the runner's thread started, and a context may be loaded)."""

    async def embed(self, request: EmbedRequest) -> Embeddings:
        """The normalised vector of each input, computed on the embedder's thread."""
        if not 1 <= len(request.inputs) <= MAX_INPUTS:
            raise Unsupported(f"embed 1 to {MAX_INPUTS} inputs per request, not {len(request.inputs)}", param="input")
        self._used = True
        try:
            return await self._runner.run("embed", False, lambda: self._embed_blocking(request))
        except RunnerClosed:
            raise EngineError(f"model {self.model_id} is shutting down") from None

    def _load(self) -> Any:
        import llama_cpp

        if self._llama is None:
            pooling = self._pooling if self._pooling not in (None, llama_cpp.LLAMA_POOLING_TYPE_NONE) \
                else llama_cpp.LLAMA_POOLING_TYPE_MEAN
            try:
                self._llama = llama_cpp.Llama(model_path=str(self.path), embedding=True, n_ctx=self.context,
                                              n_batch=self.context, n_ubatch=self.context, pooling_type=pooling,
                                              n_threads=self._threads, verbose=False)
            except (ValueError, RuntimeError, OSError) as exc:
                raise EngineError(f"llama.cpp could not open {self.path} for embeddings: {exc}") from exc
        return self._llama

    def _tokens(self, llama: Any, item: str | tuple[int, ...], index: int) -> list[int]:
        if isinstance(item, str):
            tokens = list(llama.tokenize(item.encode("utf-8"), add_bos=True, special=False))
        else:
            vocab = llama.n_vocab()
            bad = next((t for t in item if not 0 <= t < vocab), None)
            if bad is not None:
                raise Unsupported(f"input[{index}]: token id {bad} is outside this model's vocabulary (0-{vocab - 1})",
                                  param=f"input[{index}]")
            tokens = list(item)
        if not tokens:
            raise Unsupported(f"input[{index}] is empty", param=f"input[{index}]")
        if len(tokens) > self.context:
            raise PromptTooLong(f"input[{index}] is {len(tokens)} tokens; model {self.model_id} embeds at most "
                                f"{self.context}")
        return tokens

    def _embed_blocking(self, request: EmbedRequest) -> Embeddings:
        import llama_cpp

        llama = self._load()
        batches = [self._tokens(llama, item, i) for i, item in enumerate(request.inputs)]
        width = llama.n_embd()
        vectors = []
        for tokens in batches:
            llama._ctx.kv_cache_clear()
            llama._batch.reset()
            llama._batch.add_sequence(tokens, 0, True)
            llama._ctx.decode(llama._batch)
            pooled = llama_cpp.llama_get_embeddings_seq(llama._ctx.ctx, 0)
            values = [float(pooled[i]) for i in range(width)]
            norm = math.sqrt(sum(v * v for v in values)) or 1.0
            vectors.append(array("f", (v / norm for v in values)).tobytes())
        llama._batch.reset()
        return Embeddings(vectors=tuple(vectors), prompt_tokens=sum(len(t) for t in batches))

    def close(self) -> None:
        """Free the context (on the runner, after the requests already queued) and end the runner."""
        if self._used:  # (else no thread is started for nothing: this may run as the process exits)
            with contextlib.suppress(RunnerClosed):  # (closed already)
                self._runner.submit("close", self._free, priority=Priority.PREFILL)
        self._runner.close()

    def _free(self) -> None:
        if self._llama is not None:
            self._llama.close()
            self._llama = None


_EMBEDDERS: weakref.WeakKeyDictionary[Engine, LlamaEmbedder] = weakref.WeakKeyDictionary()


def embedder_for(engine: Engine) -> LlamaEmbedder:
    """The embedder of a llama.cpp engine's model (made once, loaded on first use); others cannot embed."""
    from meshllm.engine.llama import LlamaEngine

    if not isinstance(engine, LlamaEngine) or engine.metadata is None:
        raise Unsupported(f"model {engine.model_id} cannot make embeddings on this node "
                          "(only models served whole by llama.cpp can)", param="model")
    embedder = _EMBEDDERS.get(engine)
    if embedder is None:
        meta = engine.metadata
        pooling = meta.fields.get(f"{meta.architecture}.pooling_type")
        embedder = LlamaEmbedder(engine.path, engine.model_id, context=engine.context_length,
                                 pooling=int(pooling) if isinstance(pooling, int) else None, threads=engine.threads)
        _EMBEDDERS[engine] = embedder
        weakref.finalize(engine, embedder.close)
    return embedder


async def embed(engine: Engine, request: EmbedRequest) -> Embeddings:
    """Embeddings of ``request`` on ``engine``'s model, or :class:`Unsupported` (HTTP 400) if it cannot embed."""
    return await embedder_for(engine).embed(request)


async def embed_stream(engine: Engine, request: EmbedRequest) -> AsyncIterator[Embeddings]:
    """:func:`embed` as a one-event stream, so an embedding routes and tunnels like a generation."""
    yield await embed(engine, request)
