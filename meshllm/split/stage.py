"""Stage server: hosts layer ranges (ggml :class:`StageModel`) and serves ``stage-lane`` streams.

Per session it keeps the KV cache on this node, runs each Prefill/Decode through its layers in a
worker thread (an incoming lane's frames are worked through in order by a task of their own, so the
lane's reader answers Pings at once however much compute is queued), and either forwards the
activations to the next stage over its own pooled lane or, as the last stage, samples and sends
:class:`Tokens` straight back to the coordinator (whose node id and address are the chain's first
hop), over a lane it opens (and pools) to the coordinator.

Errors flow back towards the coordinator: a refused or failed frame is answered on the lane it
came in on, and an Error arriving from downstream is relayed upstream. A downstream lane that
closes, or a next-hop node the transport reports suspect or closed, fails every session routed
through it at once (an Error naming that stage), so a dead stage fails requests in well under a
second instead of after a timeout. Every node runs one server: the coordinator's replies (Tokens,
Errors) arrive on it too and are handed to the sinks registered with :meth:`route_replies`.

**Who may open sessions.** A stage placed by a coordinator (``stage-control`` ``Host``) belongs to
it: it is kept under (owner, model) with the chain it was placed for, and an ``Open`` is accepted
only when its chain starts at that owner and equals the placed chain hop for hop (nodes, addresses,
ranges); the lane already checks that it comes from the chain's previous hop. So a member outside
the plan cannot borrow the stage's compute, and a member inside it cannot redirect its output. Each
owner may keep at most :data:`MAX_SESSIONS_PER_OWNER` sessions open on this node.

**Batches.** A decode pass of one session (:class:`~meshllm.split.frames.Decode`, or a
:class:`~meshllm.split.frames.Verify` window) or of several (:class:`~meshllm.split.frames.Batch`)
runs as rounds (:meth:`StageServer._pass`): round ``r`` is one forward over position ``r`` of every
session still in the pass, each row computed exactly as a lone Decode would be
(:meth:`StageModel.batch_exact`), the weights read once for all of them. The last stage samples each
session with its own sampler and stops a window at the first draft it rejects; every stage cuts the
rejected positions from its KV when the session's next step arrives at the kept length. A session
whose step cannot run here (out of step) is refused alone; a failed forward fails every session of
the pass.

As the last stage it samples with the session's :class:`~meshllm.split.frames.Sampling`: under its
grammar (checked, then compiled over the vocabulary read from the stage's own file, which keeps the
model's metadata) and with its logprobs, returned in :class:`Tokens`. A grammar or continuation it
cannot take is refused with the ``bad-request`` code, which the coordinator answers as a 400.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import msgspec
import numpy as np

from meshllm.engine.base import InvalidRequest
from meshllm.engine.constrained import Grammar, Vocab
from meshllm.engine.gbnf import check_grammar
from meshllm.engine.ggml import StageModel
from meshllm.engine.sampler import Sampler, token_logprobs
from meshllm.errors import MeshllmError
from meshllm.net import Endpoint, NetError, PeerConnection, PeerEvent, PeerEventKind, Stream
from meshllm.split import codec
from meshllm.split.audit import Recorder
from meshllm.split.compute import Compute
from meshllm.split.frames import (
    BAD_REQUEST,
    KIND,
    LANE_FRAME_MAX,
    Batch,
    Decode,
    Error,
    Hop,
    LaneFrame,
    Open,
    Ping,
    Pong,
    Prefill,
    Reset,
    Sampling,
    Step,
    Stop,
    TokenLogprobs,
    Tokens,
    Verify,
)
from meshllm.split.lanes import MAX_ACTIVATION_BYTES, Dial, Lane, LanePool, LaneStream
from meshllm.tasks import spawn

log = logging.getLogger(__name__)

VOCAB_TIMEOUT_S = 10.0
"""How long a session with a grammar waits for a stage's vocabulary still being read (then: refused)."""
MAX_SESSIONS_PER_OWNER = 32
"""Sessions one coordinator may keep open on this node's stages (each holds a KV cache)."""
LANE_BACKLOG = 256
"""Frames of one incoming lane waiting for compute; beyond it the lane stops reading until one is done."""

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
class _LaneWork:
    """The frames of one incoming lane waiting for their turn, and the task working through them."""

    queue: asyncio.Queue[LaneFrame]
    task: asyncio.Task[None] | None = None


@dataclass
class _Hosted:
    """A hosted range: its layers, the coordinator it belongs to and the chain it was placed for.

    ``owner`` and ``chain`` are None for a stage wired by hand (tests, benchmarks), which any chain
    may use.
    """

    stage: StageModel
    owner: str | None = None
    chain: list[Hop] | None = None
    vocab: concurrent.futures.Future[Vocab] | None = None
    """The stage file's vocabulary for grammars (last stages only), read in the background when hosted."""


@dataclass
class _Session:
    open: Open
    stage: StageModel
    upstream: Lane
    downstream: Lane | None = None
    """Lane to the next stage, or (last stage) to the coordinator."""
    sampler: Sampler | None = None
    history: list[int] = field(default_factory=list)
    held: _Hosted | None = None

    @property
    def last(self) -> bool:
        return self.open.index == len(self.open.chain) - 1


class StageServer:
    """One node's stage lanes: hosted stages, their sessions, and reply routing for local coordinators."""

    def __init__(self, endpoint: Endpoint, *, max_activation_bytes: int = MAX_ACTIVATION_BYTES,
                 dial: Dial | None = None) -> None:
        self.endpoint = endpoint
        self.max_activation_bytes = max_activation_bytes
        """Largest activation payload accepted from upstream (larger steps get a ``too-large`` Error)."""
        self.pool = LanePool(endpoint, self._from_downstream, self._downstream_closed, dial=dial)
        self._stages: dict[tuple[str | None, str], _Hosted] = {}
        """(owner, model) -> hosted range; owner None: a stage any chain may use."""
        self._sessions: dict[str, _Session] = {}
        self._replies: dict[str, ReplySink] = {}
        self._vocab_loader = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="stage-vocab")
        self.compute = Compute()
        """The node's one compute runner (local coordinators use it too): steps never overlap."""
        self.recorder: Recorder | None = None
        """What this node's stages received and produced per session, for coordinators' audits (workers)."""
        self._work: dict[Lane, _LaneWork] = {}
        """Per incoming lane, its frames in order: the lane's reader only queues them, so it answers Pings
        (liveness) at once even while many steps wait for compute."""
        self._tasks: set[asyncio.Task[None]] = set()
        """Failures and ends of sessions being sent on (held so they are not collected mid-way)."""
        endpoint.on_stream(KIND, self._serve, max_frame=LANE_FRAME_MAX)
        self._unsubscribe = endpoint.on_peer_event(self._peer_event)

    # -- API for the node and the coordinator ------------------------------------------------

    def host(self, model: str, stage: StageModel, *, owner: str | None = None,
             chain: list[Hop] | None = None) -> None:
        """Serve ``stage`` (a loaded layer range) as part of ``model``'s chains (freeing the one it replaces).

        With ``owner`` (the coordinator that placed it) and ``chain``, only that exact chain may open
        sessions on it.
        """
        old = self._stages.get((owner, model))
        held = _Hosted(stage, owner, chain)
        if old is not None and old.stage is stage:
            held.vocab = old.vocab
        elif stage.last and stage.path is not None:
            # read now, off the loop: the first Open with a grammar must not spend a step's deadline on it
            held.vocab = self._vocab_loader.submit(Vocab, stage.path)
        self._stages[(owner, model)] = held
        if old is not None and old.stage is not stage:
            self._free(old.stage)

    def place(self, model: str, *, owner: str, chain: list[Hop]) -> None:
        """The owner re-placed its chain with the same layers here: accept Opens for the new chain."""
        held = self._stages.get((owner, model))
        if held is not None:
            held.chain = chain

    def unhost(self, model: str, *, owner: str | None = None) -> None:
        """Stop serving ``owner``'s ``model`` and free its layers; its sessions fail at their next step."""
        old = self._stages.pop((owner, model), None)
        if old is not None:
            self._free(old.stage)

    def _free(self, stage: StageModel) -> None:
        """Close a stage off the loop (it waits for a step in flight, then frees weights and caches).

        Sessions still open on it fail at their next step with an Error naming this stage.
        """
        try:
            asyncio.get_running_loop().run_in_executor(None, stage.close)
        except RuntimeError:  # no loop (tests, shutdown): close here
            stage.close()

    @property
    def sessions(self) -> int:
        """Sessions with KV on this node."""
        return len(self._sessions)

    def status(self) -> list[dict[str, object]]:
        """``/api/status`` ``stages``: each hosted range, whose chains may use it, and the sessions open on it."""
        return [{"model": model, "layers": [held.stage.layer_start, held.stage.layer_end], "owner": owner,
                 "sessions": sum(1 for s in self._sessions.values() if s.stage is held.stage)}
                for (owner, model), held in self._stages.items()]

    def route_replies(self, session: str, sink: ReplySink) -> Callable[[], None]:
        """Deliver Tokens and Errors for ``session`` to ``sink``; returns the function that stops it."""
        self._replies[session] = sink
        return lambda: self._replies.pop(session, None) if self._replies.get(session) is sink else None

    def close(self) -> None:
        """Close every lane, free every session and the hosted stages.

        The sessions are forgotten before the pool closes: closing our own downstream lanes must not
        read as the next stage's failure (an Error blaming it would reach the coordinator first, and
        the rebuilt chain would leave out a healthy node); upstream sees this stage's connection go.
        """
        self._unsubscribe()
        sessions = list(self._sessions.values())
        self._sessions.clear()
        self.pool.close()
        for work in self._work.values():
            if work.task is not None:
                work.task.cancel()
        self._work.clear()
        for session in sessions:
            session.stage.reset(session.open.session)
        for held in self._stages.values():
            held.stage.close()
        self._stages.clear()
        self._vocab_loader.shutdown(wait=False, cancel_futures=True)

    # -- incoming lanes ------------------------------------------------------------------------

    async def _serve(self, stream: Stream, peer: PeerConnection) -> None:
        await self.serve_lane(stream, peer.node_id or "")

    async def serve_lane(self, stream: LaneStream, peer_id: str) -> None:
        """Serve an incoming lane from ``peer_id`` (a QUIC stream, or a TLS connection to our bulk
        channel whose certificate named ``peer_id``) until it ends."""
        lane = Lane(stream, peer_id, self._from_upstream, self._upstream_closed,
                    max_activation_bytes=self.max_activation_bytes)
        await lane.run()

    async def _from_upstream(self, lane: Lane, frame: LaneFrame) -> None:
        if isinstance(frame, Tokens | Error):
            sink = self._replies.get(frame.session)
            if sink is not None:
                sink(lane.peer_id, frame)
            return
        if isinstance(frame, Ping):  # answered at once, even while this lane's steps wait for compute
            known = self._sessions.get(frame.session)
            pos = known.stage.session_length(frame.session) if known else -1
            await lane.send(Pong(nonce=frame.nonce, pos=pos))
            return
        work = self._work.get(lane)
        if work is None:
            work = self._work[lane] = _LaneWork(asyncio.Queue(LANE_BACKLOG))
            work.task = asyncio.get_running_loop().create_task(self._work_through(lane, work.queue))
        await work.queue.put(frame)  # (a full backlog holds the reader: the peer's sends wait)

    async def _work_through(self, lane: Lane, frames: asyncio.Queue[LaneFrame]) -> None:
        """A lane's frames in order: its sessions' Opens, steps, Resets and Stops, one after another."""
        while True:
            frame = await frames.get()
            try:
                await self._from_upstream_in_order(lane, frame)
            except Exception:  # a bug must not silently stop the lane's other sessions
                log.exception("stage lane from %s: frame %s failed", lane.peer_id[:12], type(frame).__name__)

    async def _from_upstream_in_order(self, lane: Lane, frame: LaneFrame) -> None:
        if isinstance(frame, Open):
            await self._open(lane, frame)
            return
        if isinstance(frame, Batch):
            await self._pass([(s, step) for step in frame.steps if (s := self._sessions.get(step.session))
                              is not None and s.upstream is lane])
            return
        session = self._sessions.get(frame.session)  # type: ignore[union-attr]
        if session is None or session.upstream is not lane:
            return  # the lane already refused it, or the session failed here before
        if isinstance(frame, Decode | Verify):
            await self._pass([(session, frame)])
        elif isinstance(frame, Prefill):
            await self._prefill(session, frame)
        elif isinstance(frame, Reset | Stop):
            await self._reset(session.stage, frame.session)
            if self._sessions.get(frame.session) is not session:
                return  # it failed meanwhile: its Error went upstream
            session.history = list(session.open.history)
            if isinstance(frame, Stop):
                del self._sessions[frame.session]
            elif session.last and session.held is not None:  # the sampler starts over too (grammar, draws)
                try:
                    session.sampler = await asyncio.to_thread(self._sampler, session.held, session.open.sampling)
                except MeshllmError as exc:
                    return await self._fail_upstream(session, "stage-error", str(exc), session.open.index)
            if session.downstream is not None and not session.last:
                await self._forward(session, frame)

    async def _open(self, lane: Lane, frame: Open) -> None:
        owner = frame.chain[0].node_id
        held = self._stages.get((owner, frame.model)) or self._stages.get((None, frame.model))
        stage = held.stage if held is not None else None
        me = frame.chain[frame.index]
        if frame.session in self._sessions:
            return await self._refuse(lane, frame, "duplicate", f"session {frame.session} is open on another lane")
        if me.node_id != self.endpoint.node_id:
            return await self._refuse(lane, frame, "not-in-plan", "this node is not that stage of the chain")
        if held is not None and held.chain is not None and frame.chain != held.chain:
            return await self._refuse(lane, frame, "not-in-plan",
                                      "the chain differs from the one its coordinator placed this stage for")
        if held is None and any(model == frame.model for _, model in self._stages):
            return await self._refuse(lane, frame, "not-in-plan",
                                      f"no stage of {frame.model} was placed here by node {owner[:12]}")
        if stage is None or (stage.layer_start, stage.layer_end) != (frame.layer_start, frame.layer_end):
            where = f"[{stage.layer_start}, {stage.layer_end})" if stage else "nothing"
            return await self._refuse(
                lane, frame, "wrong-stage",
                f"asked for {frame.model} layers [{frame.layer_start}, {frame.layer_end}), this node holds {where}",
            )
        if held is not None and held.owner is not None and sum(
                1 for s in self._sessions.values() if s.open.chain[0].node_id == owner) >= MAX_SESSIONS_PER_OWNER:
            return await self._refuse(lane, frame, "busy", f"node {owner[:12]} already has {MAX_SESSIONS_PER_OWNER} "
                                      "sessions open on this stage")
        session = _Session(frame, stage, lane)
        last = frame.index == len(frame.chain) - 1
        target = frame.chain[0] if last else frame.chain[frame.index + 1]
        try:
            session.downstream = await self.pool.get(target.node_id, target.addr)
            if not last:
                nxt = {"index": frame.index + 1, "layer_start": target.layer_start, "layer_end": target.layer_end}
                await session.downstream.send(msgspec.structs.replace(frame, **nxt))
        except (NetError, OSError, ValueError) as exc:
            culprit = 0 if last else frame.index + 1
            return await self._refuse(lane, frame, "hop-lost", f"cannot reach {target.node_id[:12]}: {exc}", culprit)
        if last:
            try:
                session.sampler = await asyncio.to_thread(self._sampler, held, frame.sampling)
            except MeshllmError as exc:  # a bad grammar or continuation: the request's fault, not the stage's
                return await self._refuse(lane, frame, BAD_REQUEST, str(exc))
            session.history = list(frame.history)
            session.held = held
        await self._reset(stage, frame.session)
        self._sessions[frame.session] = session
        if self.recorder is not None:
            self.recorder.start(frame.session, coordinator=owner, model=frame.model,
                                layers=(frame.layer_start, frame.layer_end), width=stage.hparams.width, last=last)
        return None

    async def _prefill(self, session: _Session, frame: Prefill) -> None:
        """A prompt chunk through this stage's layers; the final one sampled on the last stage."""
        sid, stage = frame.session, session.stage
        sample = session.last and frame.sample

        def compute(x: np.ndarray) -> tuple[np.ndarray | list[tuple[int, TokenLogprobs | None]], float]:
            started = time.perf_counter()
            stage.batch_exact()  # (a one-token prompt is a lone row too)
            if stage.session_length(sid) > frame.pos:
                stage.trim(sid, frame.pos)
            out: np.ndarray | list[tuple[int, TokenLogprobs | None]] = stage.forward(
                sid, x, frame.pos, last_only=session.last)
            if sample:
                token, logprobs, _ = self._sample(session, out[-1])
                out = [(token, logprobs)]
            return out, (time.perf_counter() - started) * 1e3

        try:
            x = codec.decode(frame.activations, frame.dtype, frame.n_tokens, frame.shape[1])
            out, took = await self.compute.run(session.open.model, frame.n_tokens == 1, lambda: compute(x))
        except MeshllmError as exc:
            return await self._refuse(session.upstream, frame, "stage-error", str(exc))
        if self.recorder is not None:
            self.recorder.step(sid, frame.pos, x, _token_ids(out), window=False)
        spent = [*frame.compute_ms, round(took, 3)]
        if not session.last:
            assert isinstance(out, np.ndarray)
            step = msgspec.structs.replace(frame, activations=codec.encode(out, frame.dtype), shape=out.shape,
                                           compute_ms=spent)
            return await self._forward(session, step)
        if not sample:
            return None
        assert isinstance(out, list)
        return await self._reply(session, frame, out, spent)

    def _sampler(self, held: _Hosted, sampling: Sampling) -> Sampler:
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

    async def _pass(self, items: list[tuple[_Session, Decode | Verify]]) -> None:
        """One decode pass of one or more sessions (a :class:`Decode`/:class:`Verify`, or a :class:`Batch`).

        The rows go through the layers together, round by round: round ``r`` holds position ``r`` of
        every session still in the pass (a Decode has one position, a window ``k + 1``), so each row
        is computed as a Decode of it alone would be, and one forward serves all sessions. On the last
        stage a window leaves the pass at the first draft its sampler rejects.
        """
        ready: list[tuple[_Session, Decode | Verify, np.ndarray]] = []
        for session, frame in items:
            try:
                ready.append((session, frame, codec.decode(frame.activations, frame.dtype, frame.n_tokens,
                                                           frame.shape[1])))
            except MeshllmError as exc:
                await self._refuse(session.upstream, frame, "stage-error", str(exc))
        by_stage: dict[int, list[tuple[_Session, Decode | Verify, np.ndarray]]] = {}
        for item in ready:  # (one chain's batch is one stage; a peer's mixed batch still runs per stage)
            by_stage.setdefault(id(item[0].stage), []).append(item)
        for group in by_stage.values():
            await self._pass_on(group[0][0].stage, group)

    async def _pass_on(self, stage: StageModel, items: list[tuple[_Session, Decode | Verify, np.ndarray]]) -> None:
        last = items[0][0].last

        def compute() -> tuple[list[np.ndarray | list[tuple[int, TokenLogprobs | None]]],
                               list[tuple[_Session, Step, str]], float]:
            started = time.perf_counter()
            stage.batch_exact()
            bad: list[tuple[_Session, Step, str]] = []
            live = []
            for i, (session, frame, _) in enumerate(items):
                sid = frame.session
                if stage.session_length(sid) > frame.pos:
                    stage.trim(sid, frame.pos)  # positions of the previous window the last stage did not keep
                if stage.session_length(sid) != frame.pos:
                    bad.append((session, frame, f"session {sid} is at position {stage.session_length(sid)} here, "
                                                f"the step starts at {frame.pos}"))
                else:
                    live.append(i)
            if not last:
                steps = [(items[i][1].session, items[i][2], items[i][1].pos) for i in live]
                done: list[np.ndarray | list[tuple[int, TokenLogprobs | None]]] = [np.empty(0)] * len(items)
                for i, out in zip(live, forward_rounds(stage, steps) if steps else [], strict=True):
                    done[i] = out
                return done, bad, (time.perf_counter() - started) * 1e3
            outs: list[list[tuple[int, TokenLogprobs | None]]] = [[] for _ in items]
            r = 0
            while live:
                rows = [(items[i][1].session, items[i][2][r : r + 1], items[i][1].pos + r) for i in live]
                still = []
                for i, logits in zip(live, stage.forward_batch(rows, last_only=True), strict=True):
                    session, frame, _ = items[i]
                    drafts = frame.draft if isinstance(frame, Verify) else []
                    assert session.sampler is not None
                    # a draft is kept exactly when the plain draw at its position equals it (verify_window's rule)
                    token, logprobs, keep = self._sample(session, logits[-1], drafts[r] if r < len(drafts) else None)
                    outs[i].append((token, logprobs))
                    if keep:  # a window goes on until its sampler rejects a draft: no later position is computed
                        still.append(i)
                live, r = still, r + 1
            return list(outs), bad, (time.perf_counter() - started) * 1e3

        small = len(items) == 1 and items[0][1].n_tokens == 1
        try:
            done, bad, took = await self.compute.run(items[0][0].open.model, small, compute)
        except MeshllmError as exc:  # the batch's forward failed: every session of it fails here
            for session, frame, _ in items:
                await self._refuse(session.upstream, frame, "stage-error", str(exc))
            return
        refused = {id(frame) for _, frame, _ in bad}
        for session, frame, message in bad:
            await self._refuse(session.upstream, frame, "stage-error", message)
        outgoing: dict[int, tuple[_Session, list[Decode | Verify]]] = {}
        for (session, frame, x), out in zip(items, done, strict=True):
            if id(frame) in refused or self._sessions.get(frame.session) is not session:
                continue
            if self.recorder is not None:  # what this stage took in and gave out, for the coordinator's audits
                self.recorder.step(frame.session, frame.pos, x, _token_ids(out), window=isinstance(frame, Verify))
            spent = [*frame.compute_ms, round(took, 3)]
            if last:
                assert isinstance(out, list)
                await self._reply(session, frame, out, spent)
            else:
                assert isinstance(out, np.ndarray)
                step = msgspec.structs.replace(frame, activations=codec.encode(out, frame.dtype), shape=out.shape,
                                               compute_ms=spent)
                outgoing.setdefault(id(session.downstream), (session, []))[1].append(step)
        for session, steps in outgoing.values():
            await self._forward(session, steps[0] if len(steps) == 1 else Batch(steps=steps), steps)

    async def _reply(self, session: _Session, frame: Step, out: list[tuple[int, TokenLogprobs | None]],
                     spent: list[float]) -> None:
        """The last stage's answer to ``frame``: its tokens (and their logprobs), straight to the coordinator."""
        end = frame.pos + (len(out) if isinstance(frame, Verify) else frame.n_tokens)
        finish = "length" if end + 1 >= session.open.max_context else None
        logprobs = [lp for _, lp in out if lp is not None]
        await self._forward(session, Tokens(session=frame.session, pos=end, token_ids=[t for t, _ in out],
                                            finish=finish, compute_ms=spent, logprobs=logprobs))

    def _sample(self, session: _Session, logits: np.ndarray,
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

    async def _forward(self, session: _Session, frame: LaneFrame, steps: list[Decode | Verify] | None = None) -> None:
        """Send downstream (or the reply to the coordinator); a failure goes upstream as an Error.

        A :class:`Batch` goes on ``session``'s lane, which every session of ``steps`` shares; when it
        fails, each of them fails upstream.
        """
        assert session.downstream is not None
        lane = session.downstream
        try:
            await lane.send(frame)
        except NetError as exc:
            culprit = 0 if session.last else session.open.index + 1
            for sid in [step.session for step in steps] if steps else [session.open.session]:
                if (failed := self._sessions.get(sid)) is not None:
                    await self._fail_upstream(failed, "hop-lost", f"lane to {lane.peer_id[:12]}: {exc}", culprit)

    async def _refuse(self, lane: Lane, frame: LaneFrame, code: str, message: str, stage: int | None = None) -> None:
        sid = getattr(frame, "session", "")
        lane.state.forget(sid)
        here = frame.index if isinstance(frame, Open) else lane.state.stage
        error = Error(session=sid, code=code, message=message, stage=here if stage is None else stage)
        await self._send_quietly(lane, error)

    async def _fail_upstream(self, session: _Session, code: str, message: str, stage: int) -> None:
        sid = session.open.session
        self._sessions.pop(sid, None)
        session.upstream.state.forget(sid)
        await self._reset(session.stage, sid)
        await self._send_quietly(session.upstream, Error(session=sid, code=code, message=message, stage=stage))

    async def _send_quietly(self, lane: Lane, frame: LaneFrame) -> None:
        try:
            await lane.send(frame)
        except NetError as exc:
            log.debug("could not tell %s: %s", lane.peer_id[:12], exc)

    # -- outgoing lanes --------------------------------------------------------------------------

    async def _from_downstream(self, lane: Lane, frame: LaneFrame) -> None:
        """Errors from the next stage go to the session's upstream, or to the local coordinator's sink."""
        if not isinstance(frame, Error):
            return
        if (session := self._sessions.get(frame.session)) is not None:
            await self._fail_upstream(session, frame.code, frame.message, frame.stage)
        elif (sink := self._replies.get(frame.session)) is not None:
            sink(lane.peer_id, frame)

    def _downstream_closed(self, lane: Lane, reason: str) -> None:
        self._fail_through(lane.peer_id, "hop-lost", f"lane closed: {reason}")

    def _peer_event(self, event: PeerEvent) -> None:
        if event.kind in (PeerEventKind.SUSPECT, PeerEventKind.CLOSED):
            self._fail_through(event.node_id, f"hop-{event.kind.value}", event.reason or f"node is {event.kind.value}")

    def _fail_through(self, node_id: str, code: str, message: str) -> None:
        for session in [s for s in self._sessions.values() if s.downstream and s.downstream.peer_id == node_id]:
            culprit = 0 if session.last else session.open.index + 1
            spawn(self._tasks, self._fail_upstream(session, code, message, culprit))

    def _upstream_closed(self, lane: Lane, reason: str) -> None:
        work = self._work.pop(lane, None)
        if work is not None and work.task is not None:
            work.task.cancel()
        for sid in [sid for sid, s in self._sessions.items() if s.upstream is lane]:
            spawn(self._tasks, self._end(self._sessions.pop(sid)))

    async def _end(self, session: _Session) -> None:
        """Free a session whose upstream is gone, and tell the next stage."""
        sid = session.open.session
        await self._reset(session.stage, sid)
        if session.downstream is not None and not session.last and session.downstream.closed is None:
            await self._send_quietly(session.downstream, Stop(session=sid))

    async def _reset(self, stage: StageModel, session: str) -> None:
        """Free ``session``'s KV through the node's compute runner: a reset on the loop would block it
        (lanes, probes, the API) while a step in a worker thread holds the stage."""
        await self.compute.run("reset", True, lambda: stage.reset(session))


def _token_ids(out: np.ndarray | list[tuple[int, TokenLogprobs | None]]) -> np.ndarray | list[int]:
    """A step's output as the audit recorder keeps it: rows, or the sampled token ids."""
    return out if isinstance(out, np.ndarray) else [token for token, _ in out]
