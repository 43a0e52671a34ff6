"""Stage server: the asyncio driver of the stage core, hosting layer ranges (ggml :class:`StageModel`).

What a stage decides (who may open a session, the order of a session's steps, where a result goes,
which sessions a lost lane or peer fails) is :class:`~meshllm.split.stage_core.StageCore`'s, a pure
state machine with the node's one session table. This module only carries out its actions: it reads
frames off lanes (QUIC streams or TLS connections alike) into the core, sends the frames it returns
in order on each lane, runs the jobs it asks for (dial the next hop, a prompt chunk, a decode pass,
a KV reset, a last stage's sampler) and hands their outcomes back. Every node runs one server: the
coordinator's replies (Tokens, Errors) arrive on it too and are handed to the sinks registered with
:meth:`StageServer.route_replies`.

**Compute.** Forwards, KV resets and frees go through the node's one compute runner
(:class:`~meshllm.compute.Runner`, shared with local coordinators), off the loop when they are not tiny,
decode passes before prompt chunks, so a lane's reader answers Pings at once however much work is
queued. A decode pass of one session (:class:`~meshllm.split.frames.Decode`, or a
:class:`~meshllm.split.frames.Verify` window) or of several (:class:`~meshllm.split.frames.Batch`)
runs as rounds: round ``r`` is one forward over position ``r`` of every session still in the pass,
each row computed exactly as a lone Decode would be (:meth:`StageModel.batch_exact`), the weights
read once for all of them. The last stage samples each session with its own sampler and stops a
window at the first draft it rejects; every stage cuts the rejected positions from its KV when the
session's next step arrives at the kept length.

**Sampling.** As the last stage it samples with the session's :class:`~meshllm.split.frames.Sampling`:
under its grammar (checked, then compiled over the vocabulary read from the stage's own file, which
keeps the model's metadata) and with its logprobs, returned in :class:`Tokens`. A grammar or
continuation it cannot take is refused with the ``bad-request`` code, which the coordinator answers
as a 400.

**Tasks.** Each incoming lane's jobs run in one worker task of that lane, and the frames a job
produces are sent by that worker before its next job; lane workers, sends started from callbacks
and KV frees run in the server's :class:`~meshllm.tasks.Scope` (one task group), which
:meth:`StageServer.close` cancels.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from meshllm.compute import INLINE_MAX_S, Priority, Runner, RunnerClosed
from meshllm.engine.base import InvalidRequest
from meshllm.engine.constrained import Grammar, Vocab
from meshllm.engine.gbnf import check_grammar
from meshllm.engine.ggml import StageModel
from meshllm.engine.sampler import Sampler, token_logprobs
from meshllm.errors import MeshllmError
from meshllm.net import Endpoint, NetError, PeerConnection, PeerEvent, PeerEventKind, Stream, StreamClosed
from meshllm.split import codec
from meshllm.split.audit import Recorder
from meshllm.split.errors import BadFrame
from meshllm.split.frames import (
    BAD_REQUEST,
    KIND,
    LANE_FRAME_MAX,
    Error,
    Hop,
    LaneFrame,
    Sampling,
    TokenLogprobs,
    Tokens,
    Verify,
)
from meshllm.split.lanes import MAX_ACTIVATION_BYTES, Dial, Lane, LanePool, LaneStream
from meshllm.split.stage_core import (
    LANE_BACKLOG,
    Action,
    BuildSampler,
    Connect,
    Deliver,
    Failed,
    Forget,
    HostedRange,
    Job,
    LaneId,
    Opened,
    PassOut,
    Record,
    ResetKV,
    RunPass,
    RunPrefill,
    Send,
    Session,
    StageCore,
    Start,
    StepOut,
)
from meshllm.tasks import Scope

log = logging.getLogger(__name__)

VOCAB_TIMEOUT_S = 10.0
"""How long a session with a grammar waits for a stage's vocabulary still being read (then: refused)."""

ReplySink = Callable[[str, Tokens | Error], None]
"""``sink(peer_id, frame)``: where a coordinator session receives its Tokens and Errors."""


def forward_rounds(stage: StageModel, steps: list[tuple[str, np.ndarray, int]]) -> list[np.ndarray]:
    """The rows of several sessions' steps (``(session, inputs, pos)``) through a stage that is not the last.

    Round ``r`` is one batched forward of position ``r`` of every step that has one: each row is
    computed as a Decode of it alone would be (a multi-row forward of one session attends with other
    kernels, and a verify window computed that way could keep tokens plain decoding never produces),
    while the sessions share one pass over the weights.
    """
    outs: list[list[np.ndarray]] = [[] for _ in steps]
    for r in range(max(len(x) for _, x, _ in steps)):
        live = [i for i, (_, x, _) in enumerate(steps) if r < len(x)]
        rows = [(steps[i][0], steps[i][1][r : r + 1], steps[i][2] + r) for i in live]
        for i, out in zip(live, stage.forward_batch(rows), strict=True):
            outs[i].append(out)
    return [np.concatenate(o) for o in outs]


@dataclass
class _Outbox:
    """Frames for one lane in the order the core produced them, and whether a task is sending them."""

    frames: deque[LaneFrame] = field(default_factory=deque)
    draining: bool = False


class StageServer:
    """One node's stage lanes: the stage core, hosted stages' runtimes, and reply routing for local coordinators."""

    def __init__(self, endpoint: Endpoint, *, max_activation_bytes: int = MAX_ACTIVATION_BYTES,
                 dial: Dial | None = None) -> None:
        self.endpoint = endpoint
        self.max_activation_bytes = max_activation_bytes
        """Largest activation payload accepted from upstream (larger steps get a ``too-large`` Error)."""
        self.core = StageCore(endpoint.node_id)
        self.pool = LanePool(endpoint, self._from_lane, self._lane_closed, dial=dial)
        self._lanes: dict[LaneId, Lane] = {}
        self._outboxes: dict[LaneId, _Outbox] = {}
        self._workers: dict[LaneId, asyncio.Queue[Job | None]] = {}
        """Per incoming lane, its jobs (one at a time: the core starts the next when one is done)."""
        self._unblocked: dict[LaneId, asyncio.Event] = {}
        """Readers of lanes whose backlog is full wait on these."""
        self._replies: dict[str, ReplySink] = {}
        self._vocab_loader = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="stage-vocab")
        self.compute = Runner(f"stage-compute-{endpoint.node_id[:8]}", inline_max_s=INLINE_MAX_S)
        """The node's one compute runner (local coordinators use it too): steps never overlap."""
        self.recorder: Recorder | None = None
        """What this node's stages received and produced per session, for coordinators' audits (workers)."""
        self._scope = Scope("stage server")
        endpoint.on_stream(KIND, self._serve, max_frame=LANE_FRAME_MAX)
        self._unsubscribe = endpoint.on_peer_event(self._peer_event)

    # -- API for the node and the coordinator ------------------------------------------------

    def host(self, model: str, stage: StageModel, *, owner: str | None = None,
             chain: list[Hop] | None = None) -> None:
        """Serve ``stage`` (a loaded layer range) as part of ``model``'s chains (freeing the one it replaces).

        With ``owner`` (the coordinator that placed it) and ``chain``, only that exact chain may open
        sessions on it.
        """
        old = self.core.hosted.get((owner, model))
        held = HostedRange((stage.layer_start, stage.layer_end), owner, chain, stage)
        if old is not None and old.stage is stage:
            held.vocab = old.vocab
        elif stage.last and stage.path is not None:
            # read now, off the loop: the first Open with a grammar must not spend a step's deadline on it
            held.vocab = self._vocab_loader.submit(Vocab, stage.path)
        self.core.host(model, held)
        if old is not None and old.stage is not stage:
            self._free(old.stage)

    def place(self, model: str, *, owner: str, chain: list[Hop]) -> None:
        """The owner re-placed its chain with the same layers here: accept Opens for the new chain."""
        held = self.core.hosted.get((owner, model))
        if held is not None:
            held.chain = chain

    def unhost(self, model: str, *, owner: str | None = None) -> None:
        """Stop serving ``owner``'s ``model`` and free its layers; its sessions fail at their next step."""
        old = self.core.unhost(model, owner)
        if old is not None:
            self._free(old.stage)

    def _free(self, stage: StageModel) -> None:
        """Close a stage on the compute runner, after the steps queued before (then frees weights and caches).

        Sessions still open on it fail at their next step with an Error naming this stage.
        """
        try:
            self.compute.submit("free", stage.close, priority=Priority.PREFILL)
        except RunnerClosed:  # (shutting down: close here)
            stage.close()

    @property
    def sessions(self) -> int:
        """Sessions with KV on this node."""
        return len(self.core.sessions)

    def status(self) -> list[dict[str, object]]:
        """``/api/status`` ``stages``: each hosted range, whose chains may use it, and the sessions open on it."""
        return [{"model": model, "layers": list(held.layers), "owner": owner,
                 "sessions": sum(1 for s in self.core.sessions.values() if s.hosted.stage is held.stage)}
                for (owner, model), held in self.core.hosted.items()]

    def route_replies(self, session: str, sink: ReplySink) -> Callable[[], None]:
        """Deliver Tokens and Errors for ``session`` to ``sink``; returns the function that stops it."""
        self._replies[session] = sink
        return lambda: self._replies.pop(session, None) if self._replies.get(session) is sink else None

    def close(self) -> None:
        """Close every lane, cancel every task, free every session and the hosted stages.

        The sessions are forgotten before the pool closes: closing our own downstream lanes must not
        read as the next stage's failure (an Error blaming it would reach the coordinator first, and
        the rebuilt chain would leave out a healthy node); upstream sees this stage's connection go.
        """
        self._unsubscribe()
        forgotten = self.core.close()
        self.pool.close()
        for lane in list(self._lanes.values()):
            lane.close("stage server closing")
        self._scope.close()
        self.compute.close()  # (its thread ends after the jobs already queued)
        for action in forgotten:
            if isinstance(action, Forget):
                action.hosted.stage.reset(action.session)
        for held in self.core.hosted.values():
            held.stage.close()
        self.core.hosted.clear()
        self._vocab_loader.shutdown(wait=False, cancel_futures=True)

    # -- lanes in, actions out ---------------------------------------------------------------------

    async def _serve(self, stream: Stream, peer: PeerConnection) -> None:
        await self.serve_lane(stream, peer.node_id or "")

    async def serve_lane(self, stream: LaneStream, peer_id: str) -> None:
        """Serve an incoming lane from ``peer_id`` (a QUIC stream, or a TLS connection to our bulk
        channel whose certificate named ``peer_id``) until it ends."""
        lane = Lane(stream, peer_id, self._from_lane, self._lane_closed, max_activation_bytes=self.max_activation_bytes)
        await lane.run()

    async def _from_lane(self, lane: Lane, frame: LaneFrame | BadFrame) -> None:
        """A frame read off any lane: into the core; the reader waits while the lane's backlog is full."""
        self._lanes.setdefault(lane.id, lane)
        await self._flush(self._act(self.core.receive(lane.id, frame)))
        while self.core.backlog(lane.id) >= LANE_BACKLOG and lane.closed is None:
            await self._unblocked.setdefault(lane.id, asyncio.Event()).wait()

    def _lane_closed(self, lane: Lane, reason: str) -> None:
        self._lanes.pop(lane.id, None)
        if (event := self._unblocked.pop(lane.id, None)) is not None:
            event.set()
        if (jobs := self._workers.pop(lane.id, None)) is not None:
            jobs.put_nowait(None)  # (the worker ends after the job it is running)
        self._act_later(self.core.lane_closed(lane.id, reason))

    def _peer_event(self, event: PeerEvent) -> None:
        if event.kind in (PeerEventKind.SUSPECT, PeerEventKind.CLOSED):
            self._act_later(self.core.peer_lost(event.node_id, f"hop-{event.kind.value}",
                                                event.reason or f"node is {event.kind.value}"))

    def _act(self, actions: list[Action]) -> set[LaneId]:
        """Carry out the core's actions, in order; returns the lanes that have frames to send.

        Frames are queued on their lane before anything else runs, so they leave in the order the core
        produced them; the caller sends them (:meth:`_flush`) before it goes on, so a slow next hop
        holds back the lane that feeds it.
        """
        lanes: set[LaneId] = set()
        for action in actions:
            if isinstance(action, Send):
                self._outboxes.setdefault(action.lane, _Outbox()).frames.append(action.frame)
                lanes.add(action.lane)
            elif isinstance(action, Start):
                self._worker(action.job.lane).put_nowait(action.job)
            elif isinstance(action, Forget):
                self._scope.spawn(self._reset(action.hosted.stage, action.session))
            elif isinstance(action, Deliver):
                if (sink := self._replies.get(action.frame.session)) is not None:
                    sink(action.peer, action.frame)
            elif isinstance(action, Opened):
                if self.recorder is not None:
                    session = action.session
                    self.recorder.start(session.id, coordinator=session.open.chain[0].node_id,
                                        model=session.open.model, layers=session.hosted.layers,
                                        width=session.hosted.stage.hparams.width, last=session.last)
            elif isinstance(action, Record) and self.recorder is not None and action.note is not None:
                x, out = action.note
                self.recorder.step(action.session, action.pos, x, out, window=action.window)
        for lane_id in [lane for lane in self._unblocked if self.core.backlog(lane) < LANE_BACKLOG]:
            self._unblocked.pop(lane_id).set()
        return lanes

    def _act_later(self, actions: list[Action]) -> None:
        """:meth:`_act` from a plain callback: the frames go out in a task of the server's scope."""
        if lanes := self._act(actions):
            self._scope.spawn(self._flush(lanes))

    async def _flush(self, lanes: set[LaneId]) -> None:
        """Send the frames queued on ``lanes`` (those another task is already sending, it sends)."""
        for lane_id in lanes:
            outbox = self._outboxes.get(lane_id)
            if outbox is None or outbox.draining:
                continue
            outbox.draining = True
            try:
                while outbox.frames:
                    frame = outbox.frames.popleft()
                    lane = self._lanes.get(lane_id)
                    try:
                        if lane is None or lane.closed is not None:
                            raise StreamClosed("lane closed")
                        await lane.send(frame)
                    except NetError as exc:
                        log.debug("could not send to %s: %s", lane_id.peer[:12], exc)
                        await self._flush(self._act(self.core.send_failed(lane_id, frame, str(exc))))
            finally:
                outbox.draining = False
                if not outbox.frames and (lane_id not in self._lanes):
                    self._outboxes.pop(lane_id, None)

    def _worker(self, lane_id: LaneId) -> asyncio.Queue[Job | None]:
        jobs = self._workers.get(lane_id)
        if jobs is None:
            jobs = self._workers[lane_id] = asyncio.Queue()
            self._scope.spawn(self._work(jobs))
        return jobs

    async def _work(self, jobs: asyncio.Queue[Job | None]) -> None:
        """An incoming lane's jobs, one after another: each outcome goes to the core, and the frames it
        produces are sent, before the next job starts."""
        while (job := await jobs.get()) is not None:
            outcome: object
            try:
                outcome = await self._job(job)
            except MeshllmError as exc:
                outcome = Failed("stage-error", str(exc))
            await self._flush(self._act(self.core.job_done(job, outcome)))

    async def _job(self, job: Job) -> object:
        if isinstance(job, Connect):
            session = job.session
            try:
                lane = await self.pool.get(job.node_id, job.addr)
            except (NetError, OSError, ValueError) as exc:
                culprit = 0 if session.last else session.index + 1
                return Failed("hop-lost", f"cannot reach {job.node_id[:12]}: {exc}", culprit)
            self._lanes[lane.id] = lane
            return lane.id
        if isinstance(job, BuildSampler):
            try:
                return await asyncio.to_thread(self._sampler, job.session.hosted, job.session.open.sampling)
            except MeshllmError as exc:  # a bad grammar or continuation: the request's fault, not the stage's
                return Failed(BAD_REQUEST if not job.session.ready else "stage-error", str(exc))
        if isinstance(job, ResetKV):
            await self._reset(job.session.hosted.stage, job.session.id)
            return None
        if isinstance(job, RunPrefill):
            return await self._prefill(job)
        assert isinstance(job, RunPass)
        return await self._pass(job)

    async def _reset(self, stage: StageModel, session: str) -> None:
        """Free ``session``'s KV through the node's compute runner: a reset on the loop would block it
        (lanes, probes, the API) while a step in a worker thread holds the stage."""
        await self.compute.run("reset", True, lambda: stage.reset(session))

    # -- compute -------------------------------------------------------------------------------------

    async def _prefill(self, job: RunPrefill) -> StepOut:
        """A prompt chunk through this stage's layers; the final one sampled on the last stage."""
        session, frame = job.session, job.frame
        sid, stage = frame.session, session.hosted.stage
        x = codec.decode(frame.activations, frame.dtype, frame.n_tokens, frame.shape[1])

        def compute() -> StepOut:
            started = time.perf_counter()
            stage.batch_exact()  # (a one-token prompt is a lone row too)
            if stage.session_length(sid) > frame.pos:
                stage.trim(sid, frame.pos)
            out = stage.forward(sid, x, frame.pos, last_only=session.last)
            took = (time.perf_counter() - started) * 1e3
            length = stage.session_length(sid)
            if session.last:
                tokens = [self._sample(session, out[-1])[:2]] if job.sample else []
                return StepOut(length, took, tokens=tokens, record=(x, [t for t, _ in tokens]))
            return StepOut(length, took, codec.encode(out, frame.dtype), out.shape, record=(x, out))

        return await self.compute.run(session.open.model, frame.n_tokens == 1, compute, priority=Priority.PREFILL)

    async def _pass(self, job: RunPass) -> PassOut:
        """One decode pass of one or more sessions (a :class:`Decode`/:class:`Verify`, or a :class:`Batch`).

        The rows go through the layers together, round by round: round ``r`` holds position ``r`` of
        every session still in the pass (a Decode has one position, a window ``k + 1``), so each row
        is computed as a Decode of it alone would be, and one forward serves all sessions. On the last
        stage a window leaves the pass at the first draft its sampler rejects.
        """
        items = job.items
        stage: StageModel = items[0][0].hosted.stage
        xs = [codec.decode(f.activations, f.dtype, f.n_tokens, f.shape[1]) for _, f in items]
        last = job.last

        def compute() -> PassOut:
            started = time.perf_counter()
            stage.batch_exact()
            refused: dict[int, str] = {}
            live = []
            for i, (_, frame) in enumerate(items):
                sid = frame.session
                if stage.session_length(sid) > frame.pos:
                    stage.trim(sid, frame.pos)  # positions of the previous window the last stage did not keep
                if stage.session_length(sid) != frame.pos:
                    refused[i] = (f"session {sid} is at position {stage.session_length(sid)} here, "
                                  f"the step starts at {frame.pos}")
                else:
                    live.append(i)
            rows: list[np.ndarray] = [np.empty(0)] * len(items)
            tokens: list[list[tuple[int, TokenLogprobs | None]]] = [[] for _ in items]
            if not last:
                steps = [(items[i][1].session, xs[i], items[i][1].pos) for i in live]
                for i, out in zip(live, forward_rounds(stage, steps) if steps else [], strict=True):
                    rows[i] = out
            r = 0
            while last and live:
                batch = [(items[i][1].session, xs[i][r : r + 1], items[i][1].pos + r) for i in live]
                still = []
                for i, logits in zip(live, stage.forward_batch(batch, last_only=True), strict=True):
                    session, frame = items[i]
                    drafts = frame.draft if isinstance(frame, Verify) else []
                    # a draft is kept exactly when the plain draw at its position equals it (verify_window's rule)
                    token, logprobs, keep = self._sample(session, logits[-1], drafts[r] if r < len(drafts) else None)
                    tokens[i].append((token, logprobs))
                    if keep:  # a window goes on until its sampler rejects a draft: no later position is computed
                        still.append(i)
                live, r = still, r + 1
            took = (time.perf_counter() - started) * 1e3
            outs = []
            for i, (_, frame) in enumerate(items):
                length = stage.session_length(frame.session)
                if i in refused:
                    outs.append(StepOut(length, took, refused=refused[i]))
                elif last:
                    outs.append(StepOut(length, took, tokens=tokens[i], record=(xs[i], [t for t, _ in tokens[i]])))
                else:
                    outs.append(StepOut(length, took, codec.encode(rows[i], frame.dtype), rows[i].shape,
                                        record=(xs[i], rows[i])))
            return PassOut(outs)

        small = len(items) == 1 and items[0][1].n_tokens == 1
        return await self.compute.run(items[0][0].open.model, small, compute)

    def _sampler(self, held: HostedRange, sampling: Sampling) -> Sampler:
        """Worker thread: a last stage's sampler for a session, its grammar (checked first: a peer can
        send anything) compiled over the stage file's vocabulary and advanced over the continuation."""
        if sampling.grammar is None:
            return Sampler(sampling, step=sampling.step)
        check_grammar(sampling.grammar)
        if held.vocab is None:
            raise InvalidRequest("this stage has no vocabulary file to constrain sampling with")
        try:
            vocab = held.vocab.result(timeout=VOCAB_TIMEOUT_S)
        except (concurrent.futures.TimeoutError, concurrent.futures.CancelledError) as exc:
            raise InvalidRequest(f"this stage's vocabulary is not readable yet ({type(exc).__name__})") from None
        if vocab.end_token < 0:
            raise InvalidRequest("the model has no end token, so a grammar could not end its text")
        grammar = Grammar(vocab, sampling.grammar)
        grammar.replay(sampling.generated)
        return Sampler(sampling, grammar, step=sampling.step)

    def _sample(self, session: Session, logits: np.ndarray,
                draft: int | None = None) -> tuple[int, TokenLogprobs | None, bool]:
        """The token at one position, its logprobs when the session asks, and whether ``draft`` is kept.

        The sampler's grammar advances over the token (never over a rejected draft). When the grammar
        allows nothing more, the model's end token ends the text (the coordinator stops on it).
        """
        sampler = session.sampler
        assert sampler is not None
        sampled = sampler(logits, session.history)  # a draft is kept exactly when this draw equals it
        if sampled is None:
            assert sampler.grammar is not None
            token, kept = sampler.grammar.vocab.end_token, False
        else:
            token, kept = sampled, sampled == draft
        session.history.append(token)
        k = session.open.sampling.logprobs
        return token, None if k is None else TokenLogprobs(*token_logprobs(logits, token, k)), kept
