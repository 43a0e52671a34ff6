"""An in-memory driver for the stage core: frames in, jobs run by hand, every action recorded.

Nothing here sleeps or touches a socket: a test decides when each job finishes and how, so a
cancel, a Stop or a lost lane can be put at any moment of a session's life.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import msgspec
import numpy as np

from meshllm.split import Hop, codec
from meshllm.split.errors import BadFrame
from meshllm.split.frames import Decode, LaneFrame, Open, Prefill, Verify, decode_frame
from meshllm.split.stage_core import (
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
    StageCore,
    Start,
    StepOut,
)

WIDTH = 4
UP = LaneId("coord", 1)
"""The lane from the chain's coordinator (stage 0) to this node (stage 1)."""
CHAIN = [Hop("coord", "127.0.0.1:1", 0, 2), Hop("me", "127.0.0.1:2", 2, 4), Hop("next", "127.0.0.1:3", 4, 6)]
LAST_CHAIN = CHAIN[:2]
"""A chain in which this node is the last stage (its downstream is the coordinator)."""


def rows(n: int, dtype: str = "f32") -> bytes:
    return codec.encode(np.zeros((n, WIDTH), np.float32), dtype)  # type: ignore[arg-type]


def open_frame(session: str, chain: list[Hop] = CHAIN, **fields: object) -> Open:
    return Open(session=session, model="m", layer_start=2, layer_end=4, chain=chain, index=1, **fields)  # type: ignore[arg-type]


def prefill(session: str, pos: int, n: int, *, sample: bool = True, dtype: str = "f32") -> Prefill:
    return Prefill(session=session, pos=pos, n_tokens=n, dtype=dtype, shape=(n, WIDTH),  # type: ignore[arg-type]
                   activations=rows(n, dtype), sample=sample)


def step(session: str, pos: int, draft: list[int] | None = None, *, dtype: str = "f32",
         n: int | None = None) -> Decode | Verify:
    n = (len(draft) + 1 if draft else 1) if n is None else n
    fields = {"session": session, "pos": pos, "n_tokens": n, "dtype": dtype, "shape": (n, WIDTH),
              "activations": rows(n, dtype)}
    return Verify(**fields, draft=draft) if draft else Decode(**fields)  # type: ignore[arg-type]


def raw(frame: object) -> bytes:
    return msgspec.msgpack.encode(frame)


@dataclass
class Harness:
    """A stage core with a hand-run driver: ``sent`` and ``forgotten`` record what it asked for."""

    core: StageCore = field(default_factory=lambda: StageCore("me"))
    jobs: deque[Job] = field(default_factory=deque)
    sent: list[tuple[LaneId, LaneFrame]] = field(default_factory=list)
    forgotten: list[str] = field(default_factory=list)
    delivered: list[Deliver] = field(default_factory=list)
    opened: list[str] = field(default_factory=list)
    records: list[Record] = field(default_factory=list)
    lanes: dict[str, LaneId] = field(default_factory=dict)
    """Lanes the driver dialled, by node id (one per peer, as the pool keeps them)."""
    hosted: HostedRange = field(default_factory=lambda: HostedRange((2, 4)))

    def __post_init__(self) -> None:
        self.core.host("m", self.hosted)

    def apply(self, actions: list[Action]) -> list[Action]:
        for action in actions:
            if isinstance(action, Send):
                self.sent.append((action.lane, action.frame))
            elif isinstance(action, Start):
                self.jobs.append(action.job)
            elif isinstance(action, Forget):
                self.forgotten.append(action.session)
            elif isinstance(action, Deliver):
                self.delivered.append(action)
            elif isinstance(action, Opened):
                self.opened.append(action.session.id)
            elif isinstance(action, Record):
                self.records.append(action)
        return actions

    def receive(self, frame: LaneFrame | BadFrame, lane: LaneId = UP) -> list[Action]:
        return self.apply(self.core.receive(lane, frame))

    def receive_raw(self, data: bytes, lane: LaneId = UP, max_activation_bytes: int = 1 << 20) -> list[Action]:
        """A frame as a lane reads it: decoded within the lane's limit, then into the core."""
        try:
            frame: LaneFrame | BadFrame = decode_frame(data, max_activation_bytes=max_activation_bytes)
        except BadFrame as exc:
            frame = exc
        return self.receive(frame, lane)

    def outcome(self, job: Job) -> object:
        """What the job would produce if everything went well."""
        if isinstance(job, Connect):
            return self.lanes.setdefault(job.node_id, LaneId(job.node_id, 100 + len(self.lanes)))
        if isinstance(job, BuildSampler):
            return "sampler"
        if isinstance(job, ResetKV):
            return None
        if isinstance(job, RunPrefill):
            f = job.frame
            tokens = [(7, None)] if job.sample else []
            return StepOut(f.pos + f.n_tokens, 1.0, rows(f.n_tokens, f.dtype), (f.n_tokens, WIDTH), tokens)
        assert isinstance(job, RunPass)
        outs = []
        for session, f in job.items:
            if session.last:  # every draft kept, plus the next token
                outs.append(StepOut(f.pos + f.n_tokens, 1.0, tokens=[(7, None)] * f.n_tokens))
            else:
                outs.append(StepOut(f.pos + f.n_tokens, 1.0, rows(f.n_tokens, f.dtype), (f.n_tokens, WIDTH)))
        return PassOut(outs)

    def finish(self, job: Job | None = None, outcome: object = None, *, failed: bool = False) -> list[Action]:
        """Complete ``job`` (default: the oldest) with ``outcome`` (default: a good one, or a failure)."""
        job = job if job is not None else self.jobs[0]
        self.jobs.remove(job)
        if failed:
            outcome = Failed("stage-error", "the forward failed")
        elif outcome is None:
            outcome = self.outcome(job)
        return self.apply(self.core.job_done(job, outcome))

    def run_all(self) -> None:
        while self.jobs:
            self.finish()

    def open(self, session: str, chain: list[Hop] = CHAIN, lane: LaneId = UP) -> None:
        self.receive(open_frame(session, chain), lane)
        self.run_all()

    def sent_on(self, lane: LaneId) -> list[LaneFrame]:
        return [frame for to, frame in self.sent if to == lane]
