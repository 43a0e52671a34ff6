"""The stage side of the split protocol as a sans-IO state machine (h11 style).

:class:`StageCore` is everything a stage decides, without sockets, threads or clocks: which hosted
range a session may use and who may open it, that a session's steps arrive in order and in its
dtype, which work runs next on each incoming lane, where a result goes, and which sessions a lost
lane or peer fails. The driver (:mod:`meshllm.split.stage`) feeds it frames (:meth:`~StageCore.receive`),
the outcomes of the work it asked for (:meth:`~StageCore.job_done`), failed sends
(:meth:`~StageCore.send_failed`) and lost lanes and peers (:meth:`~StageCore.lane_closed`,
:meth:`~StageCore.peer_lost`); each returns the :data:`Action` s to carry out, in order.

**One session table.** A session is known here from the moment its Open is read until it stops or
fails; its upstream lane, its next hop's lane, its expected positions and its KV length all live in
one :class:`Session`. A frame queued behind other work keeps a reference to the session it was
checked against, so a session that failed and was opened again under the same id meanwhile never
gets the old session's steps.

**Order per lane.** A lane's frames are checked as they are read (a bad one is refused at once and
changes nothing) and then worked through one at a time: the next frame's job starts only when the
previous one's outcome came back, so a Reset or Stop never overtakes the pass before it. Pings are
answered at once, however much work waits. Jobs of different lanes run side by side; the node's
compute runner serialises the forwards.

**Failing a session** takes it out of the table, frees its KV (:class:`Forget`), tells the upstream
hop (an :class:`~meshllm.split.frames.Error` naming the stage at fault) and, unless the failure came
from downstream, stops it on the next hop.
"""

from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Literal

import msgspec

from meshllm.split.errors import BadFrame
from meshllm.split.frames import (
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
    Step,
    Stop,
    TokenLogprobs,
    Tokens,
    Verify,
)

MAX_SESSIONS_PER_OWNER = 32
"""Sessions one coordinator may keep open on this node's stages (each holds a KV cache)."""
LANE_BACKLOG = 256
"""Frames of one incoming lane waiting for their turn; beyond it the driver stops reading the lane."""


@dataclass(frozen=True)
class LaneId:
    """A lane as the core knows it: the peer at its other end and a serial of the driver's.

    Whether the lane rides a QUIC stream or a TLS connection is the driver's business.
    """

    peer: str
    serial: int


@dataclass
class HostedRange:
    """A hosted layer range, the coordinator it belongs to and the chain it was placed for.

    ``owner`` and ``chain`` are None for a stage wired by hand (tests, benchmarks), which any chain may
    use. ``stage`` and ``vocab`` are the driver's runtime objects; the core never touches them.
    """

    layers: tuple[int, int]
    owner: str | None = None
    chain: list[Hop] | None = None
    stage: Any = None
    vocab: Any = None


@dataclass(eq=False)
class Session:
    """One session on this stage: the whole of what the node knows about it."""

    open: Open
    hosted: HostedRange
    upstream: LaneId
    downstream: LaneId | None = None
    """Lane to the next stage, or (last stage) to the coordinator; None while it is being dialled."""
    ready: bool = False
    """Opened on the next hop and (last stage) given its sampler."""
    next_pos: int = 0
    """Highest position the next step may start at (its length on the previous stage)."""
    low_pos: int = 0
    """Lowest: below ``next_pos`` only after a Verify, whose rejected positions the next step drops."""
    length: int = 0
    """KV length after the last step computed here (what a Ping reports)."""
    sampler: Any = None
    """Last stage: the session's sampler (built by a :class:`BuildSampler` job; driver-owned)."""
    history: list[int] = field(default_factory=list)
    """Last stage: the tokens its repetition penalties see (the prompt, then every token sampled)."""

    @property
    def id(self) -> str:
        return self.open.session

    @property
    def index(self) -> int:
        return self.open.index

    @property
    def last(self) -> bool:
        return self.open.index == len(self.open.chain) - 1


# -- jobs: work the driver runs and reports back with job_done ---------------------------------------


@dataclass(eq=False)
class Connect:
    """Get a lane to ``node_id`` at ``addr`` (pooled); outcome: the :class:`LaneId`."""

    lane: LaneId
    session: Session
    node_id: str
    addr: str


@dataclass(eq=False)
class RunPrefill:
    """Run a prompt chunk through the session's layers (sampled on the last stage if it asks);
    outcome: a :class:`StepOut`."""

    lane: LaneId
    session: Session
    frame: Prefill
    sample: bool


@dataclass(eq=False)
class RunPass:
    """One decode pass of ``items`` (sessions of one hosted range), round by round; outcome: a
    :class:`PassOut` with one entry per item."""

    lane: LaneId
    items: list[tuple[Session, Decode | Verify]]

    @property
    def last(self) -> bool:
        return self.items[0][0].last


@dataclass(eq=False)
class ResetKV:
    """Empty the session's KV (a Reset frame; the session stays open); outcome: None."""

    lane: LaneId
    session: Session


@dataclass(eq=False)
class BuildSampler:
    """Last stage: build the session's sampler (its grammar checked and compiled); outcome: the sampler."""

    lane: LaneId
    session: Session


Job = Connect | RunPrefill | RunPass | ResetKV | BuildSampler


@dataclass(frozen=True)
class StepOut:
    """What a step produced on this stage: activations for the next hop, or sampled tokens."""

    length: int
    """The session's KV length after the step."""
    took_ms: float
    activations: bytes = b""
    shape: tuple[int, int] = (0, 0)
    tokens: list[tuple[int, TokenLogprobs | None]] = field(default_factory=list)
    refused: str | None = None
    """Why the step could not run here (the session is not where the step starts): the session fails."""
    record: Any = None
    """The driver's own note of the step (for its audit recorder), handed back in :class:`Record`."""


@dataclass(frozen=True)
class PassOut:
    outs: list[StepOut]


@dataclass(frozen=True)
class Failed:
    """A job's outcome when it failed: every session of it fails with ``code``."""

    code: str
    message: str
    stage: int | None = None
    """The stage at fault (default: this one)."""


# -- actions -----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Send:
    """Send ``frame`` on ``lane`` (in the order given); a failure comes back through ``send_failed``."""

    lane: LaneId
    frame: LaneFrame


@dataclass(frozen=True)
class Start:
    """Run ``job`` and report its outcome with :meth:`StageCore.job_done`."""

    job: Job


@dataclass(frozen=True)
class Forget:
    """The session left the table: free its KV (after any step of it still computing)."""

    session: str
    hosted: HostedRange


@dataclass(frozen=True)
class Deliver:
    """A reply for a session this node coordinates (Tokens, or an Error from its chain)."""

    peer: str
    frame: Tokens | Error


@dataclass(frozen=True)
class Opened:
    """The session is open here (the driver's audit recorder starts its record)."""

    session: Session


@dataclass(frozen=True)
class Record:
    """A step of ``session`` was computed and sent on (the driver's audit recorder keeps it)."""

    session: str
    pos: int
    window: bool
    note: Any


Action = Send | Start | Forget | Deliver | Opened | Record


@dataclass
class _Lane:
    """An incoming lane's frames waiting for their turn, each with the sessions it was checked against."""

    queue: deque[tuple[LaneFrame, list[Session]]] = field(default_factory=deque)
    busy: Job | None = None
    stage: int = -1
    """This node's index in the chains of the lane's sessions (for Errors; -1 before any Open)."""


class StageCore:
    """One node's stage protocol: hosted ranges, the session table and every incoming lane's order."""

    def __init__(self, node_id: str) -> None:
        self.node_id = node_id
        self.hosted: dict[tuple[str | None, str], HostedRange] = {}
        """(owner, model) -> hosted range; owner None: a stage any chain may use."""
        self.sessions: dict[str, Session] = {}
        self._lanes: dict[LaneId, _Lane] = {}

    # -- hosting -------------------------------------------------------------------------------------

    def host(self, model: str, hosted: HostedRange) -> HostedRange | None:
        """Serve ``hosted`` as ``model``'s range for its owner; returns the range it replaces."""
        old = self.hosted.get((hosted.owner, model))
        self.hosted[(hosted.owner, model)] = hosted
        return old

    def unhost(self, model: str, owner: str | None) -> HostedRange | None:
        """Stop serving ``owner``'s ``model``; its sessions fail at their next step (the driver frees it)."""
        return self.hosted.pop((owner, model), None)

    def backlog(self, lane: LaneId) -> int:
        """Frames of ``lane`` waiting for their turn (the driver stops reading at :data:`LANE_BACKLOG`)."""
        state = self._lanes.get(lane)
        return len(state.queue) if state is not None else 0

    def busy(self, lane: LaneId) -> bool:
        state = self._lanes.get(lane)
        return state is not None and state.busy is not None

    # -- input ---------------------------------------------------------------------------------------

    def receive(self, lane: LaneId, frame: LaneFrame | BadFrame) -> list[Action]:
        """A frame read from ``lane`` (or why it could not be read): refusals and pongs at once, the
        rest queued in the lane's order."""
        if isinstance(frame, BadFrame):
            return self._refusals(lane, frame)
        if isinstance(frame, Ping):
            session = self.sessions.get(frame.session)
            return [Send(lane, Pong(nonce=frame.nonce, pos=session.length if session else -1))]
        if isinstance(frame, Pong):
            return []
        if isinstance(frame, Tokens):
            return [Deliver(lane.peer, frame)]
        if isinstance(frame, Error):
            session = self.sessions.get(frame.session)
            if session is not None and session.downstream == lane:
                return self._fail(session, frame.code, frame.message, frame.stage, stop_downstream=False)
            return [Deliver(lane.peer, frame)]
        try:
            checked = self._check(lane, frame)
        except BadFrame as exc:
            return self._refusals(lane, exc)
        self._lanes.setdefault(lane, _Lane()).queue.append((frame, checked))
        return self._next(lane)

    def job_done(self, job: Job, outcome: object) -> list[Action]:
        """The outcome of a job started by a :class:`Start` action (a :class:`Failed` if it failed)."""
        state = self._lanes.get(job.lane)
        if state is not None and state.busy is job:
            state.busy = None
        actions = self._outcome(job, outcome)
        return actions + (self._next(job.lane) if state is not None else [])

    def send_failed(self, lane: LaneId, frame: LaneFrame, message: str) -> list[Action]:
        """A send on ``lane`` failed: the sessions it was carrying on towards the coordinator fail."""
        sids = [step.session for step in frame.steps] if isinstance(frame, Batch) else [getattr(frame, "session", "")]
        actions: list[Action] = []
        for sid in sids:
            session = self.sessions.get(sid)
            if session is not None and session.downstream == lane:
                actions += self._fail(session, "hop-lost", f"lane to {lane.peer[:12]}: {message}",
                                      self._culprit(session), stop_downstream=False)
        return actions

    def lane_closed(self, lane: LaneId, reason: str) -> list[Action]:
        """``lane`` ended: its own sessions end (freed here, stopped on their next hop), and the sessions
        whose next hop it was fail upstream."""
        self._lanes.pop(lane, None)
        actions: list[Action] = []
        for session in list(self.sessions.values()):
            if session.upstream == lane:
                del self.sessions[session.id]
                actions.append(Forget(session.id, session.hosted))
                if session.downstream is not None and not session.last:
                    actions.append(Send(session.downstream, Stop(session=session.id)))
            elif session.downstream == lane:
                actions += self._fail(session, "hop-lost", f"lane closed: {reason}", self._culprit(session),
                                      stop_downstream=False)
        return actions

    def peer_lost(self, node_id: str, code: str, message: str) -> list[Action]:
        """The transport reports ``node_id`` suspect or gone: every session whose next hop it is fails."""
        actions: list[Action] = []
        for session in list(self.sessions.values()):
            if session.downstream is not None and session.downstream.peer == node_id:
                actions += self._fail(session, code, message, self._culprit(session), stop_downstream=False)
        return actions

    def close(self) -> list[Action]:
        """Everything ends: every session's KV is freed."""
        actions: list[Action] = [Forget(s.id, s.hosted) for s in self.sessions.values()]
        self.sessions.clear()
        self._lanes.clear()
        return actions

    # -- checks at read time -------------------------------------------------------------------------

    def _check(self, lane: LaneId, frame: LaneFrame) -> list[Session]:
        """The sessions ``frame`` acts on, checked to take it next; :class:`BadFrame` (nothing changed) if not."""
        if isinstance(frame, Open):
            return [self._check_open(lane, frame)]
        if isinstance(frame, Prefill | Decode | Verify):
            session = self._expected(lane, frame)
            self._advance(session, frame)
            return [session]
        if isinstance(frame, Batch):
            sessions = tuple(step.session for step in frame.steps)
            try:
                checked = [self._expected(lane, step) for step in frame.steps]
            except BadFrame as exc:  # the whole batch is refused; no session moves
                raise BadFrame(str(exc), code=exc.code, sessions=sessions) from None
            for session, step in zip(checked, frame.steps, strict=True):
                self._advance(session, step)
            return checked
        assert isinstance(frame, Reset | Stop)
        session = self._mine(lane, frame.session)
        if isinstance(frame, Reset):
            session.next_pos = session.low_pos = 0
        return [session]

    def _check_open(self, lane: LaneId, frame: Open) -> Session:
        sid = frame.session
        if frame.chain[frame.index - 1].node_id != lane.peer:
            raise BadFrame(f"open for stage {frame.index} must come from {frame.chain[frame.index - 1].node_id[:12]}",
                           code="not-in-plan", session=sid)
        self._lanes.setdefault(lane, _Lane()).stage = frame.index
        owner = frame.chain[0].node_id
        held = self.hosted.get((owner, frame.model)) or self.hosted.get((None, frame.model))
        if sid in self.sessions:
            raise BadFrame(f"session {sid} is already open", code="duplicate", session=sid)
        if frame.chain[frame.index].node_id != self.node_id:
            raise BadFrame("this node is not that stage of the chain", code="not-in-plan", session=sid)
        if held is not None and held.chain is not None and frame.chain != held.chain:
            raise BadFrame("the chain differs from the one its coordinator placed this stage for",
                           code="not-in-plan", session=sid)
        if held is None and any(model == frame.model for _, model in self.hosted):
            raise BadFrame(f"no stage of {frame.model} was placed here by node {owner[:12]}", code="not-in-plan",
                           session=sid)
        if held is None or held.layers != (frame.layer_start, frame.layer_end):
            where = f"[{held.layers[0]}, {held.layers[1]})" if held else "nothing"
            raise BadFrame(f"asked for {frame.model} layers [{frame.layer_start}, {frame.layer_end}), this node "
                           f"holds {where}", code="wrong-stage", session=sid)
        if held.owner is not None and sum(
                1 for s in self.sessions.values() if s.open.chain[0].node_id == owner) >= MAX_SESSIONS_PER_OWNER:
            raise BadFrame(f"node {owner[:12]} already has {MAX_SESSIONS_PER_OWNER} sessions open on this stage",
                           code="busy", session=sid)
        session = Session(frame, held, lane, history=list(frame.history))
        self.sessions[sid] = session
        return session

    def _mine(self, lane: LaneId, sid: str) -> Session:
        session = self.sessions.get(sid)
        if session is None or session.upstream != lane:
            raise BadFrame(f"session {sid} was not opened on this lane", code="not-in-plan", session=sid)
        return session

    def _expected(self, lane: LaneId, frame: Step) -> Session:
        """``frame``'s session, checked to take this step next (position and dtype)."""
        session = self._mine(lane, frame.session)
        if not session.low_pos <= frame.pos <= session.next_pos:
            wanted = str(session.next_pos) if session.low_pos == session.next_pos else \
                f"{session.low_pos}-{session.next_pos}"
            raise BadFrame(f"session {frame.session}: step at position {frame.pos}, expected {wanted}",
                           code="out-of-order", session=frame.session)
        if frame.dtype != session.open.dtype:
            raise BadFrame(f"{frame.dtype} activations on a {session.open.dtype} session", code="bad-dtype",
                           session=frame.session)
        return session

    @staticmethod
    def _advance(session: Session, frame: Step) -> None:
        session.next_pos = frame.pos + frame.n_tokens
        # after a window, the next step starts anywhere from its first kept position to its end
        session.low_pos = frame.pos + 1 if isinstance(frame, Verify) else session.next_pos

    def _refusals(self, lane: LaneId, exc: BadFrame) -> list[Action]:
        """The Errors answering a refused frame: one per session it names ("" for the lane)."""
        state = self._lanes.get(lane)
        stage = state.stage if state is not None else -1
        return [Send(lane, Error(session=sid, code=exc.code, message=str(exc), stage=stage))
                for sid in exc.sessions or ("",)]

    # -- a lane's work, one frame at a time ------------------------------------------------------------

    def _next(self, lane: LaneId) -> list[Action]:
        """Start the lane's next frame if it is idle (frames of sessions gone meanwhile are skipped)."""
        state = self._lanes.get(lane)
        actions: list[Action] = []
        while state is not None and state.busy is None and state.queue:
            frame, checked = state.queue.popleft()
            live = [s for s in checked if self.sessions.get(s.id) is s]
            if not live:
                continue
            job = self._job(lane, frame, live, actions)
            if job is not None:
                state.busy = job
                actions.append(Start(job))
        return actions

    def _job(self, lane: LaneId, frame: LaneFrame, live: list[Session], actions: list[Action]) -> Job | None:
        """The job that works ``frame`` (None: done here, its actions appended)."""
        session = live[0]
        if isinstance(frame, Open):
            chain = frame.chain
            target = chain[0] if session.last else chain[frame.index + 1]
            return Connect(lane, session, target.node_id, target.addr)
        if isinstance(frame, Prefill):
            return RunPrefill(lane, session, frame, session.last and frame.sample)
        if isinstance(frame, Decode | Verify):
            return RunPass(lane, [(session, frame)])
        if isinstance(frame, Batch):
            by_session = {s.id: s for s in live}
            items = [(by_session[step.session], step) for step in frame.steps if step.session in by_session]
            # one chain's batch is one hosted range; a peer's mixed batch runs as one pass per range
            groups: dict[int, list[tuple[Session, Decode | Verify]]] = {}
            for item in items:
                groups.setdefault(id(item[0].hosted), []).append(item)
            passes = list(groups.values())
            if len(passes) > 1:  # the later ranges' passes go back in front of the lane's queue
                state = self._lanes[lane]
                for group in reversed(passes[1:]):
                    state.queue.appendleft((Batch(steps=[f for _, f in group]), [s for s, _ in group]))
            return RunPass(lane, passes[0])
        if isinstance(frame, Reset):
            return ResetKV(lane, session)
        assert isinstance(frame, Stop)
        del self.sessions[session.id]
        actions.append(Forget(session.id, session.hosted))
        if session.downstream is not None and not session.last:
            actions.append(Send(session.downstream, frame))
        return None

    def _outcome(self, job: Job, outcome: object) -> list[Action]:
        if isinstance(job, RunPass):
            return self._pass_done(job, outcome)
        session = job.session
        if self.sessions.get(session.id) is not session:
            return []  # it stopped or failed meanwhile: its outcome goes nowhere
        if isinstance(outcome, Failed):
            stage = session.index if outcome.stage is None else outcome.stage
            # an Open that failed was never opened on the next hop; a step's failure is stopped there
            return self._fail(session, outcome.code, outcome.message, stage,
                              stop_downstream=not isinstance(job, Connect))
        if isinstance(job, Connect):
            assert isinstance(outcome, LaneId)
            session.downstream = outcome
            actions: list[Action] = []
            if not session.last:
                target = session.open.chain[session.index + 1]
                nxt = msgspec.structs.replace(session.open, index=session.index + 1, layer_start=target.layer_start,
                                              layer_end=target.layer_end)
                actions.append(Send(outcome, nxt))
                return actions + self._opened(session)
            state = self._lanes[job.lane]
            state.busy = BuildSampler(job.lane, session)  # (held until the sampler is built)
            return [Start(state.busy)]
        if isinstance(job, BuildSampler):
            session.sampler = outcome
            if session.ready:  # a Reset rebuilt it: pass the Reset on (a last stage has nothing downstream)
                return []
            return self._opened(session)
        if isinstance(job, ResetKV):
            session.length = 0
            session.history = list(session.open.history)
            if session.last:  # the sampler starts over too (grammar, draws)
                state = self._lanes[job.lane]
                state.busy = BuildSampler(job.lane, session)
                return [Start(state.busy)]
            assert session.downstream is not None
            return [Send(session.downstream, Reset(session=session.id))]
        assert isinstance(job, RunPrefill) and isinstance(outcome, StepOut)
        return self._step_done(session, job.frame, outcome, send=not session.last or job.sample)

    def _opened(self, session: Session) -> list[Action]:
        session.ready = True
        return [Opened(session)]

    def _pass_done(self, job: RunPass, outcome: object) -> list[Action]:
        live = [(s, f) for s, f in job.items if self.sessions.get(s.id) is s]
        if isinstance(outcome, Failed):  # the pass's forward failed: every session of it fails here
            actions: list[Action] = []
            for session, _ in live:
                actions += self._fail(session, outcome.code, outcome.message, session.index)
            return actions
        assert isinstance(outcome, PassOut)
        actions = []
        outgoing: dict[LaneId, list[Decode | Verify]] = {}
        for (session, frame), out in zip(job.items, outcome.outs, strict=True):
            if self.sessions.get(session.id) is not session:
                continue
            if out.refused is not None:
                actions += self._fail(session, "stage-error", out.refused, session.index)
                continue
            for action in self._step_done(session, frame, out, send=session.last):
                if isinstance(action, Send) and not session.last:
                    assert isinstance(action.frame, Decode | Verify)
                    outgoing.setdefault(action.lane, []).append(action.frame)
                else:
                    actions.append(action)
        for lane, steps in outgoing.items():
            actions.append(Send(lane, steps[0] if len(steps) == 1 else Batch(steps=steps)))
        return actions

    def _step_done(self, session: Session, frame: Step, out: StepOut, *, send: bool) -> list[Action]:
        """A computed step: its record, then its activations to the next hop or its tokens to the coordinator."""
        session.length = out.length
        actions: list[Action] = [Record(session.id, frame.pos, isinstance(frame, Verify), out.record)]
        spent = [*frame.compute_ms, round(out.took_ms, 3)]
        assert session.downstream is not None
        if not session.last:
            step = msgspec.structs.replace(frame, activations=out.activations, shape=out.shape, compute_ms=spent)
            actions.append(Send(session.downstream, step))
        elif send:
            end = frame.pos + (len(out.tokens) if isinstance(frame, Verify) else frame.n_tokens)
            finish: Literal["length"] | None = "length" if end + 1 >= session.open.max_context else None
            actions.append(Send(session.downstream, Tokens(
                session=session.id, pos=end, token_ids=[t for t, _ in out.tokens], finish=finish,
                compute_ms=spent, logprobs=[lp for _, lp in out.tokens if lp is not None])))
        return actions

    # -- failures ------------------------------------------------------------------------------------------

    def _culprit(self, session: Session) -> int:
        """The stage a lost next hop is: the coordinator (0) for a last stage, else the next one."""
        return 0 if session.last else session.index + 1

    def _fail(self, session: Session, code: str, message: str, stage: int, *, stop_downstream: bool = True
              ) -> list[Action]:
        """Take ``session`` out of the table, free it, tell its upstream, and stop it on its next hop."""
        if self.sessions.get(session.id) is not session:
            return []
        del self.sessions[session.id]
        actions: list[Action] = [Forget(session.id, session.hosted),
                                 Send(session.upstream, Error(session=session.id, code=code, message=message,
                                                              stage=stage))]
        if stop_downstream and session.downstream is not None and not session.last and session.ready:
            actions.append(Send(session.downstream, Stop(session=session.id)))
        return actions


_serials = itertools.count(1)


def lane_id(peer: str) -> LaneId:
    """A fresh :class:`LaneId` for a lane to or from ``peer``."""
    return LaneId(peer, next(_serials))
