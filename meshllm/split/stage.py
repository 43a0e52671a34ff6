"""Stage server: hosts layer ranges (ggml :class:`StageModel`) and serves ``stage-lane`` streams.

Per session it keeps the KV cache on this node, runs each Prefill/Decode through its layers in a
worker thread, and either forwards the activations to the next stage over its own pooled lane or,
as the last stage, samples and sends :class:`Tokens` straight back to the coordinator (whose node id
and address are the chain's first hop), over a lane it opens (and pools) to the coordinator.

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

As the last stage it samples with the session's :class:`~meshllm.split.frames.Sampling`: under its
grammar (checked, then compiled over the vocabulary read from the stage's own file, which keeps the
model's metadata) and with its logprobs, returned in :class:`Tokens`. A grammar or continuation it
cannot take is refused with the ``bad-request`` code, which the coordinator answers as a 400.

A :class:`~meshllm.split.frames.Verify` window runs position by position on every stage; the last
stage stops at the first draft its sampler rejects (:meth:`StageServer._verify`), and every stage cuts
the rejected positions from its KV when the session's next step arrives at the kept length.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
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
from meshllm.engine.sampler import Sampler, SamplingParams, token_logprobs
from meshllm.errors import MeshllmError
from meshllm.net import Endpoint, NetError, PeerConnection, PeerEvent, PeerEventKind, Stream
from meshllm.split import codec
from meshllm.split.compute import Compute
from meshllm.split.frames import (
    BAD_REQUEST,
    KIND,
    LANE_FRAME_MAX,
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
from meshllm.split.lanes import MAX_ACTIVATION_BYTES, Lane, LanePool

log = logging.getLogger(__name__)

VOCAB_TIMEOUT_S = 10.0
"""How long a session with a grammar waits for a stage's vocabulary still being read (then: refused)."""
MAX_SESSIONS_PER_OWNER = 32
"""Sessions one coordinator may keep open on this node's stages (each holds a KV cache)."""

ReplySink = Callable[[str, Tokens | Error], None]
"""``sink(peer_id, frame)``: where a coordinator session receives its Tokens and Errors."""


def forward_positions(stage: StageModel, session: str, inputs: np.ndarray, pos: int) -> np.ndarray:
    """``inputs`` run one position at a time: bit for bit what consecutive Decodes compute.

    A multi-row forward uses other kernels than a one-row one (and its logits differ), so a verify
    window computed in one call could keep tokens plain decoding would not have produced.
    """
    return np.concatenate([stage.forward(session, inputs[i : i + 1], pos + i) for i in range(len(inputs))])


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

    def __init__(self, endpoint: Endpoint, *, max_activation_bytes: int = MAX_ACTIVATION_BYTES) -> None:
        self.endpoint = endpoint
        self.max_activation_bytes = max_activation_bytes
        """Largest activation payload accepted from upstream (larger steps get a ``too-large`` Error)."""
        self.pool = LanePool(endpoint, self._from_downstream, self._downstream_closed)
        self._stages: dict[tuple[str | None, str], _Hosted] = {}
        """(owner, model) -> hosted range; owner None: a stage any chain may use."""
        self._sessions: dict[str, _Session] = {}
        self._replies: dict[str, ReplySink] = {}
        self._vocab_loader = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="stage-vocab")
        self.compute = Compute()
        """The node's one compute runner (local coordinators use it too): steps never overlap."""
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
        """Sessions with KV on this node (for load reports)."""
        return len(self._sessions)

    def route_replies(self, session: str, sink: ReplySink) -> Callable[[], None]:
        """Deliver Tokens and Errors for ``session`` to ``sink``; returns the function that stops it."""
        self._replies[session] = sink
        return lambda: self._replies.pop(session, None) if self._replies.get(session) is sink else None

    def close(self) -> None:
        """Close every lane, free every session and the hosted stages."""
        self._unsubscribe()
        self.pool.close()
        for session in list(self._sessions.values()):
            session.stage.reset(session.open.session)
        self._sessions.clear()
        for held in self._stages.values():
            held.stage.close()
        self._stages.clear()
        self._vocab_loader.shutdown(wait=False, cancel_futures=True)

    # -- incoming lanes ------------------------------------------------------------------------

    async def _serve(self, stream: Stream, peer: PeerConnection) -> None:
        lane = Lane(
            stream, peer.node_id or "", self._from_upstream, self._upstream_closed,
            max_activation_bytes=self.max_activation_bytes,
        )
        await lane.run()

    async def _from_upstream(self, lane: Lane, frame: LaneFrame) -> None:
        if isinstance(frame, Tokens | Error):
            sink = self._replies.get(frame.session)
            if sink is not None:
                sink(lane.peer_id, frame)
            return
        if isinstance(frame, Ping):
            known = self._sessions.get(frame.session)
            pos = known.stage.session_length(frame.session) if known else -1
            await lane.send(Pong(nonce=frame.nonce, pos=pos))
            return
        if isinstance(frame, Open):
            await self._open(lane, frame)
            return
        session = self._sessions.get(frame.session)  # type: ignore[union-attr]
        if session is None or session.upstream is not lane:
            return  # the lane already refused it, or the session failed here before
        if isinstance(frame, Prefill | Decode | Verify):
            await self._step(session, frame)
        elif isinstance(frame, Reset | Stop):
            session.stage.reset(frame.session)
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
        stage.reset(frame.session)
        self._sessions[frame.session] = session
        return None

    async def _step(self, session: _Session, frame: Step) -> None:
        sid, stage = frame.session, session.stage
        sample = session.last and not (isinstance(frame, Prefill) and not frame.sample)

        def compute(x: np.ndarray) -> tuple[np.ndarray | list[tuple[int, TokenLogprobs | None]], float]:
            started = time.perf_counter()
            if stage.session_length(sid) > frame.pos:
                stage.trim(sid, frame.pos)  # positions of the previous window the last stage did not keep
            out: np.ndarray | list[tuple[int, TokenLogprobs | None]]
            if isinstance(frame, Verify):
                out = self._verify(session, x, frame) if session.last else forward_positions(stage, sid, x, frame.pos)
            else:
                out = stage.forward(sid, x, frame.pos, last_only=session.last)
                if sample:
                    token, logprobs, _ = self._sample(session, out[-1])
                    out = [(token, logprobs)]
            return out, (time.perf_counter() - started) * 1e3

        try:
            x = codec.decode(frame.activations, frame.dtype, frame.n_tokens, frame.shape[1])
            out, took = await self.compute.run(session.open.model, frame.n_tokens == 1, lambda: compute(x))
        except MeshllmError as exc:
            return await self._refuse(session.upstream, frame, "stage-error", str(exc))
        spent = [*frame.compute_ms, round(took, 3)]
        if not session.last:
            assert isinstance(out, np.ndarray)
            step = msgspec.structs.replace(frame, activations=codec.encode(out, frame.dtype), shape=out.shape,
                                           compute_ms=spent)
            return await self._forward(session, step)
        if not sample:
            return None
        assert isinstance(out, list)
        end = frame.pos + (len(out) if isinstance(frame, Verify) else frame.n_tokens)
        finish = "length" if end + 1 >= session.open.max_context else None
        logprobs = [lp for _, lp in out if lp is not None]
        return await self._forward(session, Tokens(session=sid, pos=end, token_ids=[t for t, _ in out], finish=finish,
                                                   compute_ms=spent, logprobs=logprobs))

    def _sampler(self, held: _Hosted, sampling: Sampling) -> Sampler:
        """Worker thread: a last stage's sampler for a session, its grammar (checked first: a peer can
        send anything) compiled over the stage file's vocabulary and advanced over the continuation."""
        params = SamplingParams(**{f.name: getattr(sampling, f.name) for f in dataclasses.fields(SamplingParams)})
        if sampling.grammar is None:
            return Sampler(params)
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
        return Sampler(params, grammar)

    def _verify(self, session: _Session, x: np.ndarray, frame: Verify) -> list[tuple[int, TokenLogprobs | None]]:
        """The last stage's side of a window: positions one by one until the sampler rejects a draft.

        Each position is a decode step of its own (same graph, same kernels, so a kept token and its
        KV are exactly what plain decoding computes), and the positions after the first rejection
        are never computed: a rejected draft costs the last stage nothing.
        """
        sid, out = frame.session, []
        for i in range(frame.n_tokens):
            logits = session.stage.forward(sid, x[i : i + 1], frame.pos + i, last_only=True)[-1]
            token, logprobs, kept = self._sample(session, logits, frame.draft[i] if i < len(frame.draft) else None)
            out.append((token, logprobs))
            if not kept:
                break
        return out

    def _sample(self, session: _Session, logits: np.ndarray,
                draft: int | None = None) -> tuple[int, TokenLogprobs | None, bool]:
        """The token at one position, its logprobs when the session asks, and whether ``draft`` is kept.

        The sampler's grammar advances over the token (never over a rejected draft). When the grammar
        allows nothing more, the model's end token ends the text (the coordinator stops on it).
        """
        sampler = session.sampler
        assert sampler is not None
        token, kept = (sampler(logits, session.history), False) if draft is None else \
            sampler.verify(logits, session.history, draft)
        if token is None:
            assert sampler.grammar is not None
            token, kept = sampler.grammar.vocab.end_token, False
        session.history.append(token)
        k = session.open.sampling.logprobs
        return token, None if k is None else TokenLogprobs(*token_logprobs(logits, token, k)), kept

    async def _forward(self, session: _Session, frame: LaneFrame) -> None:
        """Send downstream (or the reply to the coordinator); a failure goes upstream as an Error."""
        assert session.downstream is not None
        try:
            await session.downstream.send(frame)
        except NetError as exc:
            culprit = 0 if session.last else session.open.index + 1
            await self._fail_upstream(session, "hop-lost", f"lane to {session.downstream.peer_id[:12]}: {exc}", culprit)

    async def _refuse(self, lane: Lane, frame: LaneFrame, code: str, message: str, stage: int | None = None) -> None:
        sid = getattr(frame, "session", "")
        lane.state.forget(sid)
        here = frame.index if isinstance(frame, Open) else lane.state.stage
        error = Error(session=sid, code=code, message=message, stage=here if stage is None else stage)
        await self._send_quietly(lane, error)

    async def _fail_upstream(self, session: _Session, code: str, message: str, stage: int) -> None:
        sid = session.open.session
        self._sessions.pop(sid, None)
        session.stage.reset(sid)
        session.upstream.state.forget(sid)
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
            asyncio.get_running_loop().create_task(self._fail_upstream(session, code, message, culprit))

    def _upstream_closed(self, lane: Lane, reason: str) -> None:
        for sid in [sid for sid, s in self._sessions.items() if s.upstream is lane]:
            session = self._sessions.pop(sid)
            session.stage.reset(sid)
            if session.downstream is not None and not session.last and session.downstream.closed is None:
                asyncio.get_running_loop().create_task(self._send_quietly(session.downstream, Stop(session=sid)))
