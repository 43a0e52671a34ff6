"""A hypothesis state machine against the stage core: sessions are opened, stepped, reset, stopped and
cancelled at random on two incoming lanes, jobs finish (or fail) in any order, and lanes and peers are
lost at any moment. After every step the core's table and everything it sent must still make sense.

The suite runs a few dozen examples; ``STAGE_MACHINE_EXAMPLES=2000`` runs the long search.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

from core_helpers import CHAIN, LAST_CHAIN, Harness, open_frame, prefill, step
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from meshllm.split.frames import Batch, Decode, Error, Open, Ping, Pong, Prefill, Reset, Stop, Tokens, Verify
from meshllm.split.stage_core import (
    Action,
    Connect,
    Failed,
    Forget,
    LaneId,
    PassOut,
    RunPass,
    Send,
    Session,
    StepOut,
)

SESSIONS = ["s0", "s1", "s2", "s3"]
LANES = st.sampled_from([0, 0, 0, 1])
"""Which incoming lane a frame comes on: mostly the first, so its frames queue behind each other."""


@dataclass
class _Downstream:
    """What the next hop has been told of one session: the positions its next step may start at."""

    low: int = 0
    next: int = 0
    stopped: bool = False


class StageMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.h = Harness()
        self.closed: set[LaneId] = set()
        self.serial = 1000
        self.upstream = [LaneId("coord", 1), LaneId("coord", 2)]
        """The two incoming lanes from the coordinator (a cancelled one is replaced by a new lane)."""
        self.incoming = set(self.upstream)
        self.told: dict[tuple[LaneId, str], _Downstream] = {}
        """Per next-hop lane and session, the order that lane has seen (checked like the next stage would)."""

    # -- the driver side ------------------------------------------------------------------------------

    def apply(self, call: Callable[[], list[Action]]) -> None:
        """Run one call into the core and check what it did to the table and what it sent."""
        before = dict(self.h.core.sessions)
        actions = call()
        self.h.apply(actions)
        after = self.h.core.sessions
        gone = [sid for sid, s in before.items() if after.get(sid) is not s]
        forgotten = [a.session for a in actions if isinstance(a, Forget)]
        assert sorted(forgotten) == sorted(gone), (forgotten, gone)  # each session freed once, when it leaves
        for action in actions:
            if isinstance(action, Send):
                assert action.lane not in self.closed, f"sent on a closed lane: {action}"
                self.check_downstream(action.lane, action.frame, before)

    def check_downstream(self, lane: LaneId, frame: object, before: dict[str, Session]) -> None:
        """Frames to a next hop arrive in an order its own checks accept: Open, steps in order, Stop last."""
        if lane in self.incoming:
            return
        if isinstance(frame, Open):
            self.told[(lane, frame.session)] = _Downstream()
            return
        steps = frame.steps if isinstance(frame, Batch) else [frame]
        for item in steps:
            sid = getattr(item, "session", "")
            state = self.told.get((lane, sid))
            if isinstance(item, Tokens):  # (the session may stop right after, in the same call)
                assert sid in before and before[sid].downstream == lane
                continue
            assert state is not None and not state.stopped, f"{type(item).__name__} of {sid} before its Open"
            if isinstance(item, Stop):
                state.stopped = True
            elif isinstance(item, Reset):
                state.low = state.next = 0
            elif isinstance(item, Prefill | Decode | Verify):
                assert state.low <= item.pos <= state.next, (item.pos, state)
                state.next = item.pos + item.n_tokens
                state.low = item.pos + 1 if isinstance(item, Verify) else state.next

    def new_lane(self, peer: str) -> LaneId:
        self.serial += 1
        return LaneId(peer, self.serial)

    # -- rules -------------------------------------------------------------------------------------------

    @initialize()
    def open_some(self) -> None:
        """Start from sessions already open (middle and last stage, both lanes): deep states come sooner."""
        for sid, chain, which in (("s0", CHAIN, 0), ("s1", LAST_CHAIN, 0), ("s2", CHAIN, 1)):
            self.apply(lambda sid=sid, chain=chain, which=which: self.h.core.receive(self.upstream[which],
                                                                                      open_frame(sid, chain)))
        while self.h.jobs:
            job = self.h.jobs[0]
            self.h.jobs.popleft()
            self.apply(lambda job=job: self.h.core.job_done(job, self.h.outcome(job)))

    @precondition(lambda self: self.h.jobs)
    @rule()
    def finish_oldest(self) -> None:
        """The job started first finishes well (the common case, so lanes move on)."""
        job = self.h.jobs.popleft()
        outcome = self.h.outcome(job)
        if isinstance(job, Connect) and outcome in self.closed:
            outcome = self.h.lanes[job.node_id] = self.new_lane(job.node_id)
        self.apply(lambda: self.h.core.job_done(job, outcome))

    @rule(which=LANES, sid=st.sampled_from(SESSIONS), last=st.booleans())
    def open(self, which: int, sid: str, last: bool) -> None:
        lane = self.upstream[which]
        self.apply(lambda: self.h.core.receive(lane, open_frame(sid, LAST_CHAIN if last else CHAIN)))

    def _pos(self, lane: LaneId, sid: str, data: st.DataObject) -> int:
        session = self.h.core.sessions.get(sid)
        good = session is not None and session.upstream == lane
        if good and data.draw(st.sampled_from([True] * 7 + [False])):  # mostly a step the session can take
            return data.draw(st.integers(session.low_pos, session.next_pos))  # type: ignore[union-attr]
        return data.draw(st.integers(0, 12))

    @rule(which=LANES, n=st.integers(1, 4), sample=st.booleans(), data=st.data())
    def prefill(self, which: int, n: int, sample: bool, data: st.DataObject) -> None:
        lane = self.upstream[which]
        (sid,) = self._sessions(lane, data, 1)
        self.apply(lambda: self.h.core.receive(lane, prefill(sid, self._pos(lane, sid, data), n, sample=sample)))

    def _sessions(self, lane: LaneId, data: st.DataObject, most: int) -> list[str]:
        """Mostly sessions open on ``lane``; sometimes any ids."""
        mine = sorted(sid for sid, s in self.h.core.sessions.items() if s.upstream == lane)
        pool = mine if mine and data.draw(st.sampled_from([True] * 7 + [False])) else SESSIONS
        return data.draw(st.lists(st.sampled_from(pool), min_size=1, max_size=min(most, len(pool)), unique=True))

    @rule(which=LANES, drafts=st.integers(0, 2), data=st.data())
    def decode(self, which: int, drafts: int, data: st.DataObject) -> None:
        lane = self.upstream[which]
        sids = self._sessions(lane, data, 3)
        steps = [step(sid, self._pos(lane, sid, data), list(range(1, drafts + 1)) or None) for sid in sids]
        frame = steps[0] if len(steps) == 1 else Batch(steps=steps)
        self.apply(lambda: self.h.core.receive(lane, frame))

    @rule(which=LANES, stop=st.booleans(), data=st.data())
    def reset_or_stop(self, which: int, stop: bool, data: st.DataObject) -> None:
        (sid,) = self._sessions(self.upstream[which], data, 1)
        self.apply(lambda: self.h.core.receive(self.upstream[which], Stop(session=sid) if stop else Reset(session=sid)))

    @rule(which=LANES, sid=st.sampled_from(SESSIONS))
    def ping(self, which: int, sid: str) -> None:
        actions = self.h.core.receive(self.upstream[which], Ping(nonce=1, session=sid))
        session = self.h.core.sessions.get(sid)
        assert [a.frame for a in actions] == [Pong(nonce=1, pos=session.length if session else -1)]  # type: ignore[attr-defined]

    @precondition(lambda self: self.h.jobs)
    @rule(data=st.data(), how=st.sampled_from(["ok", "ok", "ok", "failed", "refused"]))
    def finish_job(self, data: st.DataObject, how: str) -> None:
        job = data.draw(st.sampled_from(list(self.h.jobs)))
        self.h.jobs.remove(job)
        outcome = self.h.outcome(job)
        if isinstance(job, Connect):  # the pool hands out a fresh lane after a closed one
            lane = self.h.lanes[job.node_id]
            if lane in self.closed:
                lane = self.h.lanes[job.node_id] = self.new_lane(job.node_id)
            outcome = lane
        if how == "failed":
            outcome = Failed("stage-error", "boom")
        elif how == "refused" and isinstance(job, RunPass):
            outcome = PassOut([StepOut(0, 1.0, refused="elsewhere") for _ in job.items])
        elif isinstance(job, RunPass) and job.last:  # the last stage keeps a random share of each window
            outs = []
            for _, frame in job.items:
                kept = data.draw(st.integers(1, frame.n_tokens))
                outs.append(StepOut(frame.pos + kept, 1.0, tokens=[(7, None)] * kept))
            outcome = PassOut(outs)
        self.apply(lambda: self.h.core.job_done(job, outcome))

    @rule(which=LANES)
    def cancel_lane(self, which: int) -> None:
        """The coordinator's lane goes away (its requests were cancelled); a new one takes its place."""
        lane = self.upstream[which]
        self.apply(lambda: self.h.core.lane_closed(lane, "cancelled"))
        self.closed.add(lane)
        self.upstream[which] = self.new_lane("coord")
        self.incoming.add(self.upstream[which])

    @precondition(lambda self: self.h.lanes)
    @rule(data=st.data())
    def lose_next_hop(self, data: st.DataObject) -> None:
        node = data.draw(st.sampled_from(sorted(self.h.lanes)))
        lane = self.h.lanes[node]
        if data.draw(st.booleans()):
            self.apply(lambda: self.h.core.lane_closed(lane, "reset"))
            self.closed.add(lane)
        else:
            self.apply(lambda: self.h.core.peer_lost(node, "hop-suspect", "silent"))

    @precondition(lambda self: any(s.downstream is not None for s in self.h.core.sessions.values()))
    @rule(data=st.data())
    def the_next_hop_fails_a_session(self, data: st.DataObject) -> None:
        session = data.draw(st.sampled_from([s for s in self.h.core.sessions.values() if s.downstream is not None]))
        error = Error(session=session.id, code="stage-error", message="boom", stage=2)
        self.apply(lambda: self.h.core.receive(session.downstream, error))  # type: ignore[arg-type]

    @precondition(lambda self: any(lane not in self.incoming for lane, _ in self.h.sent))
    @rule(data=st.data())
    def a_send_fails(self, data: st.DataObject) -> None:
        lane, frame = data.draw(st.sampled_from([(la, f) for la, f in self.h.sent if la not in self.incoming]))
        self.apply(lambda: self.h.core.send_failed(lane, frame, "stalled"))

    # -- invariants ----------------------------------------------------------------------------------------

    @invariant()
    def the_table_holds_only_sessions_on_live_lanes(self) -> None:
        for sid, session in self.h.core.sessions.items():
            assert session.id == sid
            assert session.downstream is None or session.downstream not in self.closed
            assert session.low_pos <= session.next_pos

    @invariant()
    def one_job_at_a_time_per_lane(self) -> None:
        lanes = [job.lane for job in self.h.jobs if self.h.core.busy(job.lane)]
        assert len(lanes) == len(set(lanes))


StageMachine.TestCase.settings = settings(
    max_examples=int(os.environ.get("STAGE_MACHINE_EXAMPLES", "40")), stateful_step_count=50, deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
test_stage_core_machine = StageMachine.TestCase
