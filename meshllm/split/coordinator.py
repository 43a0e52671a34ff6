"""Coordinator: the first stage of a chain and the sampling loop of a split request.

It embeds the prompt and runs its own layers (in a worker thread), sends the activations down the
chain in :class:`Prefill` chunks and then one :class:`Decode` per token, and waits for each
:class:`Tokens` from the last stage, yielding token ids as they come. With speculation
(:mod:`meshllm.engine.speculate`) a step whose text continues an n-gram seen before becomes a
:class:`Verify` window instead: the token plus drafted ones in one frame, so the hops are paid once
for every token the last stage keeps; the window's size comes from the acceptance rate and the
pass costs the stages report (``compute_ms``). Every wait has a deadline
(decode: ``decode_timeout``; prefill: that plus ``prefill_s_per_token`` per token) and ends early
on anything that proves a stage dead: an Error relayed up the chain, the transport reporting a
chain node suspect or closed (the coordinator connects to every stage so its probes watch them
all). A missed deadline is attributed by pinging every stage with the session: the first stage
that does not answer, or has not reached the expected position, is the one named in
:class:`StageFailed`. Stop travels down the chain when the request ends, however it ends.

What is decided rather than waited on (which steps share a pass and when it leaves, the deadlines,
the speculation window, the order of a session's release after its pass) is the pure
:mod:`meshllm.split.coordinator_core`; this module computes, sends and waits.
"""

from __future__ import annotations

import asyncio
import contextlib
import statistics
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass

import numpy as np

from meshllm.compute import Priority
from meshllm.engine.base import InvalidRequest
from meshllm.engine.ggml import StageModel
from meshllm.engine.speculate import Acceptance, ChainCosts, NgramDrafter, SpecStats, SpeculateMode, WindowPolicy
from meshllm.errors import DecodeError
from meshllm.net import NetError, PeerEvent, PeerEventKind
from meshllm.split import codec
from meshllm.split.coordinator_core import (
    Deadlines,
    Pass,
    PassSchedule,
    Ready,
    answers,
    next_draft,
    smoothed,
)
from meshllm.split.errors import SplitError, StageFailed
from meshllm.split.frames import (
    BAD_REQUEST,
    MAX_BATCH,
    Batch,
    Decode,
    Error,
    Hop,
    Open,
    Prefill,
    Sampling,
    Step,
    Stop,
    TokenLogprobs,
    Tokens,
    Verify,
)
from meshllm.split.lanes import Lane, probe_timeout
from meshllm.split.stage import StageServer, forward_rounds
from meshllm.split.stage_core import MAX_SESSIONS_PER_OWNER
from meshllm.tasks import Scope
from meshllm.wire.addr import parse_addr

STAGE_SAMPLES = 256
"""Passes over which each stage's compute time is summarised (a median: robust to load spikes)."""
DEFAULT_BATCH = 8
"""Sessions of a chain that decode together in one pass (``--split-batch``)."""


@dataclass(frozen=True)
class SplitToken:
    """One generated token of a split request."""

    token_id: int
    finish: str | None
    """``"stop"`` (a stop id was sampled) or ``"length"`` (context or ``max_tokens`` reached) on the last one."""
    logprobs: TokenLogprobs | None = None
    """Its logprob and top alternatives, when the request's :attr:`Sampling.logprobs` asked for them."""
    rows: tuple[int, ...] | None = None
    """On the first token of a decode pass's reply: the ids that pass sent down the chain (the token
    before it, then any drafts); None on the prefill's token and the rest of a reply. What a replay
    on a rebuilt chain sends again (:class:`Replay`)."""


@dataclass(frozen=True)
class Replay:
    """A request's passes on a chain that failed, to run again on a rebuilt one before going on.

    The rebuilt chain is opened with the failed chain's prompt and sampling, and re-runs its prefill
    and then each pass with exactly the rows it sent (a lone token, or a token and its drafts), so every
    stage computes each position in a call of the same shape as before. ggml's attention takes another
    kernel for one query row than for several, so a prefill of the generated tokens can give other
    logits than their decode steps gave (SmolLM2-135M: up to 0.7 in a logit, enough to flip a greedy
    choice; docs/architecture.md); re-running the passes gives the same ones.
    """

    tokens: Sequence[int]
    """Every token the failed chain produced, in order (the prefill's first)."""
    passes: Sequence[tuple[int, ...]]
    """The rows of each decode pass it ran after the prefill (:attr:`SplitToken.rows`), in order."""


class ReplayDiverged(SplitError):
    """The rebuilt chain answered a replayed pass with other tokens than the failed chain did."""


MORE_DEADLINES = 4
"""Extra deadlines a chain whose stages answer pings gets while their positions move (see ``_await``)."""


class SplitCoordinator:
    """Runs split requests for one model whose first layers (``first``) this node holds.

    ``chain`` is the plan as hops, ``chain[0]`` being this node. ``on_stage_failed`` is told about
    every :class:`StageFailed` so the node can mark the node suspect and replan. ``speculate`` is the
    mode (``off``, ``on``, ``auto``); the pass costs and acceptance it learns are the chain's, shared
    by its requests. ``batch``: how many requests' decode steps go down the chain as one pass.
    """

    def __init__(
        self,
        server: StageServer,
        model: str,
        first: StageModel,
        chain: Sequence[Hop],
        *,
        deadlines: Deadlines | None = None,
        on_stage_failed: Callable[[StageFailed], None] | None = None,
        speculate: SpeculateMode = "auto",
        batch: int = DEFAULT_BATCH,
    ) -> None:
        if not 1 <= batch <= min(MAX_BATCH, MAX_SESSIONS_PER_OWNER):
            raise ValueError(f"a split batch holds 1 to {min(MAX_BATCH, MAX_SESSIONS_PER_OWNER)} sessions")
        if len(chain) < 2 or chain[0].node_id != server.endpoint.node_id:
            raise ValueError("a split chain has at least two stages and starts at this node")
        if (first.layer_start, first.layer_end) != (chain[0].layer_start, chain[0].layer_end):
            raise ValueError("the first stage's layers differ from the chain's first hop")
        self.server = server
        self.model = model
        self.first = first
        self.chain = list(chain)
        self.deadlines = deadlines or Deadlines()
        self.on_stage_failed = on_stage_failed
        self._compute = server.compute
        self.step_s = 0.0
        """Recent decode step time (exponential average): sets how soon a silent chain is checked."""
        self.speculate: SpeculateMode = speculate
        self.costs = ChainCosts()
        """Measured pass costs of this chain (hops, per position, per kept token)."""
        self.acceptance = Acceptance()
        """Acceptance over every request: the prior of the next request's window policy."""
        self.stats = SpecStats(speculate)
        self._stage_s: list[deque[float]] = [deque(maxlen=STAGE_SAMPLES) for _ in self.chain]
        self._serve_s: deque[float] = deque(maxlen=STAGE_SAMPLES)
        """Seconds per token between a reply and the next step: the consumer's (engine, API, stream) share."""
        self.batch = batch
        """Most sessions in one decode pass: the chain's slots (1: one session's step at a time)."""
        self.batcher = _Batcher(self, batch)
        self.prefill_sent = 0
        """Prompt tokens sent down the chain so far: prefill work a later step may queue behind."""
        self._releases = Scope("split releases")
        """Ended sessions still freeing their first-stage KV and sending their Stop."""

    @property
    def serve_seconds(self) -> float | None:
        """Median time per token the request's consumer takes between passes (None before any)."""
        return statistics.median(self._serve_s) if self._serve_s else None

    def stage_seconds(self) -> list[float | None]:
        """Median compute of each stage over recent passes: per position, the last stage per kept token.

        What the planner should price this chain's nodes at (``placement.measured_speeds``), measured
        by the stages themselves under whatever else their machines run.
        """
        return [statistics.median(d) if d else None for d in self._stage_s]

    def _observe_stages(self, first_s: float, compute_ms: list[float], positions: int, tokens: int) -> None:
        if len(compute_ms) != len(self.chain) - 1:
            return
        self._stage_s[0].append(first_s / positions)
        for i, ms in enumerate(compute_ms[:-1], start=1):
            self._stage_s[i].append(ms / 1e3 / positions)
        self._stage_s[-1].append(compute_ms[-1] / 1e3 / tokens)

    async def generate(
        self,
        prompt: Sequence[int],
        *,
        max_tokens: int,
        sampling: Sampling | None = None,
        dtype: codec.Dtype = "f32",
        session: str | None = None,
        replay: Replay | None = None,
    ) -> AsyncIterator[SplitToken]:
        """Stream the tokens generated after ``prompt``; raises :class:`StageFailed` naming a failed stage.

        With ``replay``, first re-run a failed chain's passes silently (``max_tokens`` counts the tokens
        after them); :class:`ReplayDiverged` if this chain answers one with other tokens.
        """
        run = _Run(self, session or uuid.uuid4().hex, dtype)
        policy = WindowPolicy(self.speculate, prior=self.acceptance.rate)
        drafter = NgramDrafter(prompt) if self.speculate != "off" else None
        try:
            await run.start(list(prompt), sampling or Sampling())
            reply = await run.prefill(list(prompt))
            rows: tuple[int, ...] | None = None
            if replay is not None:
                reply = await self._replay(run, reply, replay, policy, drafter)
            produced = 0
            while True:
                replied = time.perf_counter()
                if replay is None:
                    for i, token_id in enumerate(reply.token_ids):
                        produced += 1
                        last = i == len(reply.token_ids) - 1
                        finish = (reply.finish if last else None) or ("length" if produced == max_tokens else None)
                        yield SplitToken(token_id, finish, reply.logprobs[i] if reply.logprobs else None,
                                         rows if i == 0 else None)
                        if finish:
                            return
                replay = None  # (the replayed passes' last reply was yielded by the chain that failed)
                draft: list[int] = []
                if drafter is not None:
                    drafter.extend(reply.token_ids)
                    # a pass yields up to len(draft) + 1 tokens, and plain decoding ends one short of the context
                    room = min(max_tokens - produced, self.first.max_context - 1 - reply.pos) - 1
                    draft = next_draft(drafter, policy, self.costs, room)
                self._serve_s.append((time.perf_counter() - replied) / len(reply.token_ids))
                rows = (reply.token_ids[-1], *draft)
                reply = await run.step(reply.token_ids[-1], reply.pos, draft)
                kept = len(reply.token_ids) - 1
                if draft:
                    policy.observe(len(draft), kept)
                    self.acceptance.observe(len(draft), kept)
                else:
                    policy.produced(reply.token_ids)
                self.stats.observe(len(draft), kept, len(reply.token_ids))
        except StageFailed as exc:
            if self.on_stage_failed is not None:
                self.on_stage_failed(exc)
            raise
        finally:
            # the release runs in the coordinator's scope, to its end even if this task is cancelled
            # again meanwhile (anyio's cancel scopes re-cancel every await of a request whose client
            # went away); the request waits for it unless it is cancelled
            await asyncio.shield(run.finish())

    async def _replay(self, run: _Run, reply: Tokens, replay: Replay, policy: WindowPolicy,
                      drafter: NgramDrafter | None) -> Tokens:
        """Re-run ``replay``'s passes after the prefill's ``reply``; the last pass's reply. The drafter and
        the window policy see them as the failed chain's loop did, so drafting goes on as it would have."""
        tokens, at = list(replay.tokens), 0

        def check(got: Tokens, what: str) -> None:
            nonlocal at
            want = tokens[at : at + len(got.token_ids)]
            if list(got.token_ids) != want or got.finish:
                raise ReplayDiverged(f"the rebuilt chain answered {what} with {list(got.token_ids)}, "
                                     f"the failed chain with {want}")
            at += len(got.token_ids)

        check(reply, "the prefill")
        for i, rows in enumerate(replay.passes):
            if rows[0] != reply.token_ids[-1]:
                raise ReplayDiverged(f"replayed pass {i} starts with {rows[0]}, not the token before it")
            if drafter is not None:
                drafter.extend(reply.token_ids)
            draft = list(rows[1:])
            reply = await run.step(rows[0], reply.pos, draft)
            check(reply, f"replayed pass {i}")
            if draft:
                policy.observe(len(draft), len(reply.token_ids) - 1)
            else:
                policy.produced(reply.token_ids)
        if at != len(tokens):
            raise ReplayDiverged(f"the replayed passes gave {at} of the {len(tokens)} tokens")
        return reply

    def batching_status(self) -> dict[str, object]:
        """Batching figures for ``/api/status``: sessions per pass allowed, passes sent, their mean size."""
        b = self.batcher.plan
        return {"batch": self.batch, "passes": b.passes, "steps": b.steps,
                "mean_batch": round(b.steps / b.passes, 2) if b.passes else None, "decoding": len(b.decoding)}

    def speculation_status(self) -> dict[str, object]:
        """Speculation figures for ``/api/status``: counters, acceptance, and the measured pass costs."""
        costs = self.costs
        measured = {"fixed_ms": round(costs.fixed * 1e3, 3), "per_position_ms": round(costs.per_position * 1e3, 3),
                    "per_token_ms": round(costs.per_token * 1e3, 3),
                    "plain_ms_per_token": round(costs(0, 1.0) * 1e3, 3)} if costs.measured else None
        if measured is not None and (serve := self.serve_seconds) is not None:
            measured["serve_ms_per_token"] = round(serve * 1e3, 3)
        return {**self.stats.status(), "acceptance_estimate": round(self.acceptance.rate, 3), "pass_costs": measured}


class _Run:
    """One request's state: its session, lanes, reply queue and failure watch."""

    def __init__(self, coord: SplitCoordinator, session: str, dtype: codec.Dtype) -> None:
        self.c = coord
        self.session = session
        self.dtype = dtype
        self.lane: Lane | None = None
        self.replies: asyncio.Queue[Tokens | Error | StageFailed] = asyncio.Queue()
        self._index = {hop.node_id: i for i, hop in enumerate(coord.chain)}
        self._cleanup: list[Callable[[], object]] = []
        self._prefill_seen = 0
        """``prefill_sent`` at this session's previous step: prompt work sent since may be ahead of the next."""

    async def start(self, prompt: list[int], sampling: Sampling) -> None:
        c, server = self.c, self.c.server
        self._cleanup.append(server.route_replies(self.session, self._reply))
        self._cleanup.append(server.endpoint.on_peer_event(self._peer_event))
        try:  # every stage at once; the first unreachable one cancels the other attempts
            async with asyncio.TaskGroup() as group:
                for i in range(1, len(c.chain)):
                    group.create_task(self._connect(i))
        except* StageFailed as failed:
            raise failed.exceptions[0] from None
        hop = c.chain[1]
        try:
            self.lane = await server.pool.get(hop.node_id, hop.addr)
            penalties = sampling.repeat_penalty != 1.0 or sampling.presence_penalty or sampling.frequency_penalty
            await self.lane.send(Open(
                session=self.session, model=c.model, layer_start=hop.layer_start, layer_end=hop.layer_end,
                dtype=self.dtype, chain=c.chain, index=1, sampling=sampling,
                history=prompt if penalties else [], max_context=c.first.max_context,
            ))
        except NetError as exc:
            raise StageFailed(1, hop.node_id, f"lane unreachable: {exc}") from None

    async def prefill(self, prompt: list[int]) -> Tokens:
        d = self.c.deadlines
        for pos in range(0, len(prompt), d.prefill_chunk):
            ids = prompt[pos : pos + d.prefill_chunk]
            x, _ = await self._run_first(ids, pos)
            last = pos + len(ids) >= len(prompt)
            self.c.prefill_sent += len(ids)
            await self._send(Prefill(
                session=self.session, pos=pos, n_tokens=len(ids), dtype=self.dtype, shape=x.shape,
                activations=codec.encode(x, self.dtype), sample=last,
            ))
        ahead = self.c.prefill_sent - len(prompt) - self._prefill_seen  # other requests' prompts sent meanwhile
        self._prefill_seen = self.c.prefill_sent
        return await self._await(len(prompt) - 1, len(prompt), d.prefill(len(prompt), ahead))

    async def step(self, token: int, pos: int, draft: list[int]) -> Tokens:
        """One decode pass from ``pos``: ``token`` alone (a Decode) or with ``draft`` (a Verify window).

        The step goes down the chain in the next pass of the coordinator's :class:`_Batcher`, beside
        the steps of the chain's other sessions ready at the same time.
        """
        loop = asyncio.get_running_loop()
        started = loop.time()
        ids = [token, *draft]
        first_s, rows = await self.c.batcher.step(self, ids, pos, draft)
        c = self.c
        # prompt chunks sent since this session's previous step may be computed before it on every stage
        ahead, self._prefill_seen = c.prefill_sent - self._prefill_seen, c.prefill_sent
        timeout, check = c.deadlines.step(c.step_s, len(ids), rows, ahead)
        try:
            reply = await self._await(pos, pos + len(ids), timeout, check_after=check)
        finally:
            c.batcher.returned(self)
        took = loop.time() - started
        if not draft:
            c.step_s = c.batcher.plan.step_s = smoothed(c.step_s, took)
        if reply.compute_ms:  # the stages' own figures: what of the pass was compute and what was hops
            upstream = first_s + sum(reply.compute_ms[:-1]) / 1e3
            c.costs.observe(took, len(ids), len(reply.token_ids), upstream, reply.compute_ms[-1] / 1e3)
            c._observe_stages(first_s, reply.compute_ms, len(ids), len(reply.token_ids))
        return reply

    def finish(self) -> asyncio.Future[None]:
        """End the session: leave the batcher and the reply routing now, then (in the coordinator's
        scope; the returned future says when it is done) free its first-stage KV and send ``Stop``."""
        sending = self.c.batcher.leave(self)
        for undo in self._cleanup:
            undo()
        return self.c._releases.spawn(self._release(sending))

    async def _release(self, sending: asyncio.Future[None] | None) -> None:
        # a pass holding this session's step may be computing: it goes out first (without the step), so
        # the Stop cannot overtake it on the lane and the first stage is not reset under it; the pass is
        # bounded by its compute and its lane sends' deadline
        if sending is not None:
            await asyncio.wait([sending])
        first, session = self.c.first, self.session
        # through the node's compute runner: a reset on the loop would stall it while a step holds the stage
        await self.c._compute.run("reset", True, lambda: first.reset(session))
        if self.lane is not None and self.lane.closed is None:
            with contextlib.suppress(NetError):  # (a lane gone: the stage frees the session as it ends)
                await self.lane.send(Stop(session=self.session))

    # -- internals ---------------------------------------------------------------------------

    async def _connect(self, index: int) -> None:
        hop = self.c.chain[index]
        try:
            await self.c.server.endpoint.connect(
                parse_addr(hop.addr), hop.node_id, timeout=self.c.deadlines.connect_timeout
            )
        except (NetError, OSError, DecodeError) as exc:
            raise StageFailed(index, hop.node_id, f"unreachable: {exc}") from None

    async def _run_first(self, ids: list[int], pos: int) -> tuple[np.ndarray, float]:
        """This node's layers on a prompt chunk ``ids`` at ``pos`` and the seconds they took.

        The chunk queues in turn with the chain's decode passes, not after them: full passes queue
        back to back on a chain whose first stage is its heavy one, and a prompt ranked below them
        waited until the other requests ended (5 s to a first token at 8 streams).
        """
        tokens = np.asarray(ids, dtype=np.int64)
        first, session = self.c.first, self.session

        def compute() -> tuple[np.ndarray, float]:
            started = time.perf_counter()
            first.batch_exact()  # (a one-token prompt is a lone row too)
            out = first.forward(session, tokens, pos)
            return out, time.perf_counter() - started

        return await self.c._compute.run("first", len(ids) == 1, compute, priority=Priority.DECODE)

    async def _send(self, frame: Step) -> None:
        assert self.lane is not None
        try:
            await self.lane.send(frame)
        except NetError as exc:
            raise StageFailed(1, self.c.chain[1].node_id, f"lane lost: {exc}") from None

    async def _await(self, start: int, end: int, timeout: float, check_after: float | None = None) -> Tokens:
        """The Tokens of the step that started at ``start`` and consumed at most up to ``end``.

        A Decode's reply ends at ``end``; a Verify's anywhere after ``start`` (as many positions as
        tokens came back). A stage that does not answer a Ping once ``check_after`` has passed fails
        the request; the early check only fails a stage that is silent (dead or cut off): a slow but
        answering chain gets the whole ``timeout``, so load spikes do not cost requests, and another
        ``timeout`` each time the stages' positions have moved since the last check.
        """
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        check = loop.time() + check_after if check_after is not None and check_after < timeout else None
        seen: list[int | None] = []  # the stages' positions at the last missed deadline
        extended = 0
        while True:
            wait_until = check if check is not None else deadline
            try:
                item = await asyncio.wait_for(self.replies.get(), max(0.0, wait_until - loop.time()))
            except TimeoutError:
                if check is not None:
                    check = None
                    pongs = await asyncio.gather(*(self._ping(i) for i in range(1, len(self.c.chain))))
                    silent = next((i for i, pong in enumerate(pongs, start=1) if pong is None), None)
                    if silent is not None and self.replies.empty():
                        node = self.c.chain[silent].node_id
                        raise StageFailed(silent, node, f"no answer to a ping after {check_after:.2f}s") from None
                    continue
                failed, pongs = await self._diagnose(start + 1, timeout)
                # a chain whose stages all answer is slow, not dead (a first pass builds each stage's
                # graphs; a loaded host runs them, and sends the reply, late): another deadline while
                # the stages' positions move (at most MORE_DEADLINES), a failure once a whole deadline
                # passed without them moving
                if None not in pongs and pongs != seen and extended < MORE_DEADLINES:
                    seen, deadline, extended = pongs, loop.time() + timeout, extended + 1
                    continue
                raise failed from None
            if isinstance(item, StageFailed):
                raise item
            if isinstance(item, Error):
                if item.code == BAD_REQUEST:  # the request's fault (its grammar, its continuation): a 400
                    raise InvalidRequest(f"the chain's last stage refused the request: {item.message}")
                stage = min(max(item.stage, 0), len(self.c.chain) - 1)
                raise StageFailed(stage, self.c.chain[stage].node_id, f"{item.code}: {item.message}")
            if answers(item, start, end):
                return item

    def _reply(self, peer_id: str, frame: Tokens | Error) -> None:
        """Reply sink: Tokens count only from the last stage; Errors from any chain node."""
        last = self.c.chain[-1].node_id
        if (isinstance(frame, Tokens) and peer_id == last) or (isinstance(frame, Error) and peer_id in self._index):
            self.replies.put_nowait(frame)

    def _peer_event(self, event: PeerEvent) -> None:
        index = self._index.get(event.node_id)
        if index and event.kind in (PeerEventKind.SUSPECT, PeerEventKind.CLOSED):
            why = f"connection {event.kind.value}" + (f": {event.reason}" if event.reason else "")
            self.replies.put_nowait(StageFailed(index, event.node_id, why))

    async def _diagnose(self, pos: int, timeout: float) -> tuple[StageFailed, list[int | None]]:
        """Name the stage behind a missed deadline: the first that is silent or behind ``pos``; with
        every stage's pong position (None: no answer)."""
        pongs = await asyncio.gather(*(self._ping(i) for i in range(1, len(self.c.chain))))
        for index, pong in enumerate(pongs, start=1):
            node = self.c.chain[index].node_id
            if pong is None:
                return StageFailed(index, node, f"no answer after a {timeout:.2f}s deadline"), pongs
            if pong < pos:
                return StageFailed(index, node, f"stalled at position {pong} of {pos} after {timeout:.2f}s"), pongs
        last = len(self.c.chain) - 1
        return StageFailed(last, self.c.chain[last].node_id, f"no tokens within {timeout:.2f}s"), pongs

    async def _ping(self, index: int) -> int | None:
        hop = self.c.chain[index]
        try:
            timeout = probe_timeout(self.c.server.endpoint, hop.node_id)
            lane = await asyncio.wait_for(self.c.server.pool.get(hop.node_id, hop.addr), 2 * timeout)
            pong = await lane.probe(timeout, session=self.session)
        except (NetError, TimeoutError):
            return None
        return None if pong is None else pong.pos


class _Batcher:
    """Driver of the coordinator's :class:`~meshllm.split.coordinator_core.PassSchedule`: the first
    stage's rows for each pass it launches, one frame down the chain, and its wake-up timer."""

    def __init__(self, coord: SplitCoordinator, batch: int) -> None:
        self.c = coord
        self.plan: PassSchedule[_Run] = PassSchedule(len(coord.chain), batch, coord.deadlines.decode_timeout)
        self._waiting: dict[_Run, asyncio.Future[tuple[float, int]]] = {}
        """Per session with a step queued or in a pass being sent: resolves once its pass is on its way
        down the chain, with the first stage's seconds and the rows the stages compute before its reply."""
        self._sending: dict[int, asyncio.Future[None]] = {}
        """Passes being computed or sent, by id: what a leaving session's release waits for."""
        self._timer: asyncio.TimerHandle | None = None
        self._scope = Scope("split passes")

    async def step(self, run: _Run, ids: list[int], pos: int, draft: list[int]) -> tuple[float, int]:
        """Queue ``run``'s step and wait until its pass is sent; the first stage's seconds and the rows the
        stages compute before its reply (its pass's, and those of the passes in flight ahead of it)."""
        sent: asyncio.Future[tuple[float, int]] = asyncio.get_running_loop().create_future()
        self._waiting[run] = sent
        self._launch(self.plan.queue(Ready(run, ids, pos, draft), self._now()))
        return await sent

    def returned(self, run: _Run) -> None:
        """``run``'s reply came back: its next step follows once its consumer took the tokens."""
        self._launch(self.plan.returned(run, self._now()))

    def leave(self, run: _Run) -> asyncio.Future[None] | None:
        """``run`` ends: drop its waiting step and stop waiting for it; returns the pass its release
        must wait for (one holding its step, still being computed or sent), if any."""
        passes, sending = self.plan.leave(run, self._now())
        waiting = self._waiting.pop(run, None)
        if waiting is not None and not waiting.done():
            waiting.cancel()
        self._launch(passes)
        return self._sending.get(sending) if sending is not None else None

    @staticmethod
    def _now() -> float:
        return asyncio.get_running_loop().time()

    def _launch(self, passes: list[Pass[_Run]]) -> None:
        for p in passes:
            self._sending[p.id] = self._scope.spawn(self._send(p))
        if self._timer is not None and (self.plan.wake_at is None or self.plan.wake_at != self._timer.when()):
            self._timer.cancel()
            self._timer = None
        if self.plan.wake_at is not None and self._timer is None:
            self._timer = asyncio.get_running_loop().call_at(self.plan.wake_at, self._woken)

    def _woken(self) -> None:
        self._timer = None
        self._launch(self.plan.wake(self._now()))

    async def _send(self, p: Pass[_Run]) -> None:
        """The first stage's rows for the whole pass, then one frame down the chain for it."""
        try:
            await self._compute_and_send(p)
        except BaseException as exc:  # every session of the pass learns why (a first-stage error as it is)
            for r in p.steps:
                waiting = self._waiting.get(r.session)
                if waiting is not None and not waiting.done():
                    if isinstance(exc, Exception):
                        waiting.set_exception(exc)
                    else:
                        waiting.cancel()
            if not isinstance(exc, Exception):
                raise
        finally:
            del self._sending[p.id]
            self._launch(self.plan.finished(p, self._now()))

    async def _compute_and_send(self, p: Pass[_Run]) -> None:
        first = self.c.first
        group = p.steps
        steps = [(r.session.session, np.asarray(r.ids, dtype=np.int64), r.pos) for r in group]

        def compute() -> tuple[list[np.ndarray | None], float]:
            started = time.perf_counter()
            first.batch_exact()
            live = []
            for i, (session, _, pos) in enumerate(steps):
                if first.session_length(session) > pos:
                    first.trim(session, pos)  # a step right after a window drops its rejected positions
                if first.session_length(session) == pos:
                    live.append(i)  # (not a session that ended, and was reset, after its step was queued)
            outs: list[np.ndarray | None] = [None] * len(steps)
            for i, out in zip(live, forward_rounds(first, [steps[i] for i in live]) if live else [], strict=True):
                outs[i] = out
            return outs, time.perf_counter() - started

        outs, first_s = await self.c._compute.run("first", len(group) == 1 and len(group[0].ids) == 1, compute)
        self._launch(self.plan.computed(p, self._now()))  # (the next pass computes while this one is sent)
        lanes: dict[int, list[tuple[int, Decode | Verify]]] = {}  # (a lane replaced meanwhile: its own frame)
        for i, (r, x) in enumerate(zip(group, outs, strict=True)):
            waiting = self._waiting.get(r.session)
            if x is None or waiting is None or waiting.done():  # (a session that left meanwhile: not sent)
                outs[i] = None
                continue
            run = r.session
            fields = {"session": run.session, "pos": r.pos, "n_tokens": len(r.ids), "dtype": run.dtype,
                      "shape": x.shape, "activations": codec.encode(x, run.dtype)}
            lanes.setdefault(id(run.lane), []).append(
                (i, Verify(**fields, draft=r.draft) if r.draft else Decode(**fields)))
        for items in lanes.values():
            frames = [frame for _, frame in items]
            try:
                await group[items[0][0]].session._send(frames[0] if len(frames) == 1 else Batch(steps=frames))
            except StageFailed as exc:  # that lane's sessions fail; those on the other lanes went on
                for i, _ in items:
                    waiting = self._waiting.get(group[i].session)
                    if waiting is not None and not waiting.done():
                        waiting.set_exception(exc)
                    outs[i] = None
        sent = [r for r, x in zip(group, outs, strict=True) if x is not None]
        rows = self.plan.sent(p, [r.session for r in sent], sum(len(x) for x in outs if x is not None))
        for r in sent:
            waiting = self._waiting.pop(r.session, None)
            if waiting is not None and not waiting.done():
                waiting.set_result((first_s, rows))
