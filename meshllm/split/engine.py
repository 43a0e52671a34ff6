"""SplitEngine: a model served by a chain of stages, behind the same :class:`Engine` interface as a local model.

The API routes cannot tell it from :class:`~meshllm.engine.ggml.engine.GgmlEngine`: it tokenizes
(the coordinator holds the tokenizer), streams text with stop strings cut, and reports usage. The chain
itself is swappable: placement (:mod:`meshllm.split.placement`) attaches a :class:`SplitCoordinator`
when a plan is hosted and detaches it when a stage fails; meanwhile requests get a 503 that says why,
instead of hanging on a chain that no longer exists.

End of generation is decided here, not on the last stage (no stop ids go down the chain): the next
``Decode`` is only sent after the previous token was consumed, so stopping costs no wasted step.

**Replay**: when a stage fails mid-request, placement rebuilds the chain (a spare worker, or fewer
stages) and attaches it; the request waits for that (bounded by ``replay_wait_s``) and brings the new
chain to where the old one was, from the token ids (never re-encoded text), then goes on, so the
client's stream continues. The text core is the request's own throughout, so nothing is sent twice.
The new chain is opened as the old one was and re-runs its passes with the same rows
(:class:`~meshllm.split.coordinator.Replay`): every position is computed in a call of the shape it
had, so the logits and the text are the uninterrupted ones even where a model's prefill and decode
steps differ (ggml's attention has one kernel for a lone query row and another for several:
SmolLM2-135M's greedy text changed after a prefill replay). When the passes would take longer than
``replay_passes_s``, or the new chain answers one otherwise, the generated tokens are prefilled in
one go instead (exact where a prefill computes as the decode steps did: Gemma 3 270M, the tiny test
models); a seeded request's draws go on from step ``k`` either way (docs/splits.md).

Grammars and logprobs are the last stage's work, since it samples: the request's grammar goes down
in the session's :class:`~meshllm.split.frames.Sampling` (checked here first, so a bad one is a 400
before the chain sees it), with the continuation it has already produced, and each
:class:`~meshllm.split.frames.Tokens` brings the tokens' logprobs back as ids, which get their text here.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from pathlib import Path

import msgspec

from meshllm.engine.base import (
    REPLAY_STEPS_S,
    Engine,
    EngineError,
    EngineNotLoaded,
    GenerationEvent,
    GenerationParams,
    GenerationRequest,
    LoadReport,
    SamplingParams,
    TokenLogprob,
    TokenRate,
    check_supported,
    context_cap,
)
from meshllm.engine.gbnf import check_grammar
from meshllm.engine.ggml.engine import SUPPORTS, replay
from meshllm.engine.sampler import check_logprobs, check_sampling, logprob_entry
from meshllm.engine.text import TextStream, token_budget
from meshllm.engine.tokenizer import Tokenizer
from meshllm.models.metadata import read_metadata
from meshllm.split.auditor import FinishedRequest
from meshllm.split.coordinator import Replay, ReplayDiverged, SplitCoordinator, SplitToken
from meshllm.split.errors import StageFailed
from meshllm.split.frames import Sampling

log = logging.getLogger(__name__)


NO_CHAIN = "no chain yet"
"""How placement's reason starts when it could not build a chain (a replaying request stops waiting)."""


class ChainUnavailable(EngineNotLoaded):
    """No chain serves the model right now (planning, replanning, or a stage just failed): HTTP 503.

    Not :class:`EngineBusy`: a chain being rebuilt is not a saturated node, so a request that finds
    no other server gets a 503, not a 429 telling the client the mesh is full."""

    hint = "the node is rebuilding the chain; retry in a few seconds"


def chain_sampling(params: GenerationParams, generated: Sequence[int] = ()) -> Sampling:
    """The request's sampling fields (:class:`SamplingParams`) for the last stage's sampler, with the
    request's grammar (checked here: :class:`~meshllm.engine.gbnf.BadGrammar`), the tokens of its
    continuation the grammar has produced (``generated``), the step its draws start at (one per
    token of ``generated``), and the logprobs it asks for.

    A sampled request without a seed gets a fresh random one here rather than on the last stage, so
    the coordinator can recompute its draws in an audit (the text is as random either way).
    """
    check_logprobs(params)
    check_sampling(params)
    grammar = params.grammar or None
    if grammar is not None:
        check_grammar(grammar)
    seed = params.seed
    if params.temperature > 0 and seed is None:
        seed = secrets.randbits(63)
    fields = {name: getattr(params, name) for name in SamplingParams.__struct_fields__}
    return Sampling(**{**fields, "seed": seed}, grammar=grammar,
                    logprobs=params.logprobs, generated=list(generated) if grammar else [], step=len(generated))


class SplitEngine(Engine):
    """Serves ``model_id`` through whichever chain is attached; 503 while none is."""

    supports = SUPPORTS

    def __init__(self, path: Path, model_id: str, max_context: int, *, max_replays: int = 2,
                 replay_wait_s: float = 30.0, replay_passes_s: float = REPLAY_STEPS_S,
                 on_event: Callable[..., None] | None = None) -> None:
        """``max_replays``: chain rebuilds one request may ride out (0: a failed stage ends it);
        ``replay_wait_s``: how long it waits for the rebuilt chain; ``replay_passes_s``: the longest
        predicted re-run of the failed chain's passes (longer: their tokens are prefilled, see
        :class:`~meshllm.split.coordinator.Replay`); ``on_event(type, **fields)``: the node's events."""
        self.path = path
        self.model_id = model_id
        self.max_context = max_context
        self.max_replays = max_replays
        self.replay_wait_s = replay_wait_s
        self.replay_passes_s = replay_passes_s
        self.on_event = on_event or (lambda *_a, **_k: None)
        self.tokenizer: Tokenizer | None = None
        self.coordinator: SplitCoordinator | None = None
        self.unavailable = "planning the chain"
        """Why no chain is attached (shown in the 503)."""
        self.replays = 0
        """Requests continued on a rebuilt chain after a stage failed (``/api/status`` ``splits``)."""
        self.replays_failed = 0
        """Requests whose chain could not be rebuilt in time (the client got the error)."""
        self._news = asyncio.Event()
        """Set (and replaced) whenever a chain is attached or detached: what a replaying request waits on."""
        self._running = 0
        self._rate = TokenRate()
        self.on_finished: Callable[[SplitCoordinator, FinishedRequest], None] | None = None
        """Told about every request the chain served to its end (the node's audits)."""
        self._served = False
        """A chain was attached once: the model is listed from then on (a replan keeps it listed)."""

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

    @property
    def listed(self) -> bool:
        """Listed in ``/v1/models`` once a chain first formed: while its stages are placed (and fetch
        their layers) it cannot serve, and requests for it get a 503 that says so."""
        return self._served

    def attach(self, coordinator: SplitCoordinator) -> None:
        """Serve new requests (and requests replaying after a failed stage) through ``coordinator``'s chain."""
        self.coordinator = coordinator
        self._served = True
        self._announce()

    def detach(self, reason: str) -> None:
        """Stop taking requests until the next :meth:`attach`; ``reason`` goes into the 503s."""
        self.coordinator = None
        self.unavailable = reason
        self._announce()

    def _announce(self) -> None:
        news, self._news = self._news, asyncio.Event()
        news.set()

    async def _rebuilt(self, failed: SplitCoordinator, exc: StageFailed) -> SplitCoordinator:
        """The chain placement attaches after ``failed`` lost a stage; :class:`ChainUnavailable` naming
        ``exc`` when it cannot (placement gave up, or ``replay_wait_s`` passed)."""
        deadline = time.monotonic() + self.replay_wait_s
        while self.coordinator is None or self.coordinator is failed:
            news = self._news
            try:
                await asyncio.wait_for(news.wait(), timeout=max(0.0, deadline - time.monotonic()))
            except TimeoutError:
                raise ChainUnavailable(f"{exc}; no new chain within {self.replay_wait_s:g}s") from exc
            if self.coordinator is None and self.unavailable.startswith(NO_CHAIN):
                raise ChainUnavailable(f"{exc}; the chain cannot be rebuilt ({self.unavailable})") from exc
        return self.coordinator

    async def _replay(self, failed: SplitCoordinator, exc: StageFailed, tokens: int, replay: int,
                      passes: int) -> SplitCoordinator:
        """Wait for the rebuilt chain after ``exc``, telling the node's events and log (``passes``: how many
        of the failed chain's passes the new one re-runs; 0 when it prefills the tokens)."""
        self.on_event("split_replay", model=self.model_id, stage=exc.stage_index, failed_node=exc.node_id,
                      tokens=tokens, replay=replay)
        started = time.monotonic()
        try:
            coordinator = await self._rebuilt(failed, exc)
        except ChainUnavailable as gone:
            self.replays_failed += 1
            self.on_event("split_replay_failed", model=self.model_id, error=str(gone), replay=replay)
            log.warning("split %s: %s", self.model_id, gone)
            raise
        self.replays += 1
        took_ms = round((time.monotonic() - started) * 1000)
        self.on_event("split_replayed", model=self.model_id, stages=len(coordinator.chain), tokens=tokens,
                      replay=replay, took_ms=took_ms, passes=passes)
        log.info("split %s: stage %d failed (%s); continuing on a rebuilt %d-stage chain after %d tokens "
                 "(%d ms; %s)", self.model_id, exc.stage_index, exc.reason, len(coordinator.chain), tokens, took_ms,
                 f"re-running {passes} passes" if passes else "prefilling them")
        return coordinator

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
        return self.tokenizer.request_prompt(request, self.model_id, self.max_context)

    async def generate(self, request: GenerationRequest) -> AsyncIterator[GenerationEvent]:
        """Stream ``request`` through the chain, riding out up to ``max_replays`` chain rebuilds; a failed
        stage whose chain cannot be rebuilt ends it with :class:`ChainUnavailable` naming the stage."""
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
                          limit=limit, prompt_tokens=len(prompt),
                          end_on_repeated_call=request.params.end_on_repeated_call)
        fed = replay(text, request, coordinator.first.hparams.vocab)
        if text.done:
            for event in text.finish():
                yield event
            return
        sampling = chain_sampling(request.params, fed)
        started = time.monotonic()
        self._running += 1
        session = uuid.uuid4().hex  # the last attempt's session: the one an audit replays
        produced = list(fed)  # every token id fed to ``text``
        # The last chain's opening (its prompt is prompt + produced[:opened], with ``opening``'s sampling)
        # and the rows of each decode pass it ran since (SplitToken.rows): what a rebuilt chain re-runs.
        opened, opening = len(fed), sampling
        passes: list[tuple[int, ...]] = []
        replays = 0
        by_passes = False  # whether the next chain re-runs the last one's passes (Replay)
        try:
            while True:
                session = uuid.uuid4().hex
                rerun = None
                if replays and by_passes:  # the same opening, then the same passes: the same logits
                    sampling, rerun = opening, Replay(produced[opened:], list(passes))
                elif replays:  # prefilled after the prompt: the new last stage's draws (and grammar) start after them
                    sampling = msgspec.structs.replace(
                        sampling, step=len(produced), generated=list(produced) if sampling.grammar else [])
                    opened, opening, passes = len(produced), sampling, []
                tokens = coordinator.generate(prompt + produced[:opened], max_tokens=max(limit - len(produced), 1),
                                              sampling=sampling, session=session, replay=rerun)
                try:
                    async for token in tokens:
                        if token.rows is not None:
                            passes.append(token.rows)
                        produced.append(token.token_id)
                        logprob = None if sampling.logprobs is None else self._logprob(tokenizer, token)
                        delta = text.feed(token.token_id, last=bool(token.finish), logprob=logprob)
                        if delta is not None:
                            yield delta
                        if text.done:
                            break
                    break
                except ReplayDiverged as exc:  # the rebuilt chain computes otherwise after all: prefill them
                    log.warning("split %s: %s; prefilling the generated tokens instead", self.model_id, exc)
                    by_passes = False
                except StageFailed as exc:
                    if replays >= self.max_replays:
                        raise ChainUnavailable(str(exc)) from exc
                    replays += 1
                    by_passes = len(produced) > opened and self._replay_by_passes(coordinator, len(passes))
                    coordinator = await self._replay(coordinator, exc, len(produced), replays,
                                                     len(passes) if by_passes else 0)
                finally:
                    await tokens.aclose()
        finally:
            self._running -= 1
            self._rate.observe(text.generated - len(fed), started, time.monotonic())
        # an audit replays one chain's session, the last (after a rebuild, the new chain's: its prompt is the
        # request's and what it was opened with, its tokens all it produced or re-ran), and recomputes plain
        # draws (not a grammar's)
        if self.on_finished is not None and sampling.grammar is None:
            self.on_finished(coordinator, FinishedRequest(session, prompt + produced[:opened], produced[opened:],
                                                          sampling))
        for event in text.finish():
            yield event

    def _replay_by_passes(self, failed: SplitCoordinator, passes: int) -> bool:
        """Whether a replay re-runs the failed chain's ``passes`` (exact) rather than prefilling their tokens
        (one pass, exact only where a model's prefill computes as its decode steps): while they are
        predicted to take at most :attr:`replay_passes_s` at the failed chain's step time."""
        return passes * failed.step_s <= self.replay_passes_s

    @staticmethod
    def _logprob(tokenizer: Tokenizer, token: SplitToken) -> TokenLogprob:
        """The engine contract's logprob entry for a token the last stage reported figures for."""
        if token.logprobs is None:
            raise EngineError("the chain's last stage sent no logprobs for a request that asked for them")
        return logprob_entry(tokenizer.token_bytes, token.token_id, token.logprobs.logprob, token.logprobs.top)

