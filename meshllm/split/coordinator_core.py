"""The coordinator side of the split protocol as pure state: the pass schedule, deadlines as data,
the speculation window, and the release order.

:class:`PassSchedule` decides which sessions' decode steps go down the chain together and when;
it takes the time and returns the passes to send and the instant it wants to be woken
(:attr:`PassSchedule.wake_at`), never sleeping itself. The deadline helpers turn a request's
:class:`Deadlines`, the chain's recent step time and the work queued ahead of a step into the
seconds a driver may wait for its reply. The driver (:mod:`meshllm.split.coordinator`) computes the
first stage's rows, sends the frames and waits on the lanes.

**Release order.** A session that ends while a pass holding its step is being computed or sent
leaves the schedule at once, and :meth:`PassSchedule.leave` names that pass: the session's KV is
freed and its Stop sent only after it, so a Stop never overtakes its pass on the lane and the first
stage is never reset under a forward that still uses it.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from meshllm.engine.speculate import ChainCosts, NgramDrafter, WindowPolicy
from meshllm.split.frames import MAX_DRAFT, Tokens

K = TypeVar("K", bound=Hashable)

GATHER_S = 0.003
"""Longest a ready session waits for the chain's other decoding sessions to join its pass."""


@dataclass(frozen=True)
class Deadlines:
    """Per-hop deadlines of a split request."""

    decode_timeout: float = 1.0
    """Seconds for one token to go around the chain."""
    prefill_s_per_token: float = 0.05
    """Extra seconds allowed per prompt token in a prefill chunk."""
    prefill_chunk: int = 256
    """Prompt tokens per Prefill frame (bounds frame size and per-hop latency)."""
    connect_timeout: float = 1.0
    soft_factor: float = 8.0
    """A decode step slower than this many times the recent average triggers a liveness check."""
    soft_min: float = 0.2
    """Floor of that check's delay in seconds (scheduling noise must not cause pings every token)."""

    def prefill(self, prompt: int, ahead: int) -> float:
        """Seconds to wait for a prompt's first token: ``ahead`` prompt tokens of other requests were
        sent down the chain since this session's previous step, and are computed first."""
        return self.decode_timeout + self.prefill_s_per_token * (prompt + max(ahead, 0))

    def step(self, step_s: float, positions: int, rows: int, ahead: int) -> tuple[float, float]:
        """``(timeout, check_after)`` for a decode step of ``positions`` positions whose pass holds
        ``rows`` rows (its own and those of the passes in flight ahead of it) after ``ahead`` prompt
        tokens: each counts like a prompt token on every stage. Past ``check_after`` a silent stage is
        looked for; a slow but answering chain gets the whole timeout."""
        backlog = self.prefill_s_per_token * (rows - 1 + ahead)
        check = max(self.soft_min, self.soft_factor * step_s * positions) + backlog if step_s else self.decode_timeout
        return self.decode_timeout + backlog, check


def smoothed(average: float, sample: float) -> float:
    """The chain's recent step time after one more step (an exponential average)."""
    return sample if not average else 0.8 * average + 0.2 * sample


def answers(reply: Tokens, start: int, end: int) -> bool:
    """Whether ``reply`` answers the step that started at ``start`` and consumed at most up to ``end``
    (a Decode's reply ends at ``end``; a Verify's anywhere after ``start``)."""
    return reply.pos - len(reply.token_ids) == start and reply.pos <= end


def next_draft(drafter: NgramDrafter, policy: WindowPolicy, costs: ChainCosts, room: int) -> list[int]:
    """The drafted tokens the next pass verifies (empty: a plain Decode).

    ``room``: tokens the request may still produce beyond the pass's own one. A window is drafted only
    once the chain's pass costs are measured, and sized by the policy from them and the acceptance.
    """
    if not costs.measured or room <= 0:
        return []
    found = drafter.draft(min(room, MAX_DRAFT))
    draft = found[: policy.window(len(found), costs)]
    if not draft:
        policy.decline(found)
    return draft


@dataclass(frozen=True)
class Ready(Generic[K]):
    """A session's next decode step, waiting for its pass."""

    session: K
    ids: list[int]
    pos: int
    draft: list[int]


@dataclass(frozen=True)
class Pass(Generic[K]):
    """Steps that go down the chain as one frame (a Batch when there are several)."""

    id: int
    steps: list[Ready[K]]


@dataclass
class PassSchedule(Generic[K]):
    """The coordinator's step scheduler: the decode steps of sessions ready in the same tick go as one pass.

    The decoding sessions are spread over one pass in flight per stage of the chain, each of up to
    ``batch`` sessions: while stage 1 computes one pass the coordinator computes the next, so every
    stage has work and each shares its weight reads among the pass's rows. A pass leaves as soon as
    it is full, when a stage would be idle and nobody is about to join (the sessions not in flight are
    all ready), or after :data:`GATHER_S` for sessions whose clients are still reading their tokens;
    but a pass that is not full never leaves while the coordinator still computes the previous one's
    first-stage rows: it would only wait for them, so the steps ready meanwhile gather and go
    together once they are computed.
    When every stage already has a pass, a session that becomes ready (its prefill just ended) waits
    for one to come back, at most about two passes (never beyond ``max_wait``), and joins it:
    staggered sessions merge instead of each running alone. Sessions still prefilling are not
    waited for. A session that finishes, is cancelled or fails leaves at once (:meth:`leave`).
    """

    stages: int
    batch: int
    max_wait: float
    step_s: float = 0.0
    """The chain's recent decode step time (the driver keeps it current): how long a merge may wait."""
    decoding: set[K] = field(default_factory=set)
    """Sessions past their prefill and not finished: those a pass waits for."""
    in_flight: dict[K, int] = field(default_factory=dict)
    """Sessions whose step was sent and whose reply has not come back yet, with the pass they went in."""
    ready: list[Ready[K]] = field(default_factory=list)
    sending: dict[K, int] = field(default_factory=dict)
    """Sessions whose step is in a pass being computed or sent, with that pass."""
    computing: int | None = None
    """The pass whose first-stage rows the coordinator is computing (or is about to)."""
    wake_at: float | None = None
    """When the driver must call :meth:`wake` (None: nothing waits on time)."""
    passes: int = 0
    """Passes sent (each one frame down the chain)."""
    steps: int = 0
    """Session steps sent in them: ``steps / passes`` is the mean batch."""
    _rows: dict[int, int] = field(default_factory=dict)
    """Rows of each pass sent and still in flight."""
    _ids: int = 0

    def queue(self, step: Ready[K], now: float) -> list[Pass[K]]:
        """``step``'s session is ready for its next pass; the passes to launch now."""
        self.decoding.add(step.session)
        self.ready.append(step)
        return self._launches(now)

    def returned(self, session: K, now: float) -> list[Pass[K]]:
        """``session``'s reply came back: its next step follows once its consumer took the tokens."""
        self.in_flight.pop(session, None)
        return self._launches(now)

    def leave(self, session: K, now: float) -> tuple[list[Pass[K]], int | None]:
        """``session`` ends: its waiting step (if any) is dropped and nobody waits for it any more.

        Returns the passes to launch now and the pass holding its step that is still being computed or
        sent (None if none): the session's release (KV freed, Stop sent) must wait for it.
        """
        self.decoding.discard(session)
        self.in_flight.pop(session, None)
        self.ready = [r for r in self.ready if r.session != session]
        return self._launches(now), self.sending.get(session)

    def wake(self, now: float) -> list[Pass[K]]:
        """The instant in :attr:`wake_at` came: the sessions gathered so far go."""
        self.wake_at = None
        return self._launch(len(self.ready)) if self.ready and self.computing is None else []

    def sent(self, p: Pass[K], sessions: list[K], rows: int) -> int:
        """``p`` went down the chain with the steps of ``sessions`` (those still live, whose lane took it)
        and ``rows`` rows: returns the rows the stages compute before its replies (its own and those
        of the passes in flight ahead of it)."""
        self.passes += 1
        self.steps += len(sessions)
        live = set(self.in_flight.values())
        ahead = sum(n for pid, n in self._rows.items() if pid in live)
        self._rows = {pid: n for pid, n in self._rows.items() if pid in live} | {p.id: rows}
        for session in sessions:
            if session in self.decoding:
                self.in_flight[session] = p.id
        return rows + ahead

    def computed(self, p: Pass[K], now: float) -> list[Pass[K]]:
        """``p``'s first-stage rows are computed (its frames go next): the steps that gathered behind it
        may go; the passes to launch now."""
        if self.computing == p.id:
            self.computing = None
        return self._launches(now)

    def finished(self, p: Pass[K], now: float) -> list[Pass[K]]:
        """``p``'s computing and sending ended (however): releases waiting for it may go, and so may the
        steps that gathered behind it if it ended before :meth:`computed`; the passes to launch now."""
        for step in p.steps:
            if self.sending.get(step.session) == p.id:
                del self.sending[step.session]
        return self.computed(p, now)

    # -- policy ------------------------------------------------------------------------------------------

    def _launches(self, now: float) -> list[Pass[K]]:
        # one pass in flight per stage keeps every stage busy; each pass holds up to ``batch`` sessions
        cap = max(1, min(self.batch, -(-len(self.decoding) // self.stages)))
        out = []
        while len(self.ready) >= cap:  # (a full pass queues on the coordinator's device: it has no one to wait for)
            out += self._launch(cap)
        if not self.ready or self.computing is not None:
            # a pass that is not full never queues behind one the coordinator is computing: it would
            # only wait there, so the steps ready meanwhile gather, and :meth:`computed` launches them
            self.wake_at = None
            return out
        passes = len({*self.in_flight.values(), *self.sending.values()})  # (one being sent is about to be)
        serving = len(self.decoding - self.in_flight.keys() - self.sending.keys() - {r.session for r in self.ready})
        if passes < self.stages and serving <= 0:
            return self._launch(len(self.ready))  # nobody else is about to join: a stage is idle, start it
        # wait for a pass in flight to come back and merge with it (about a pass), or briefly for the
        # sessions whose clients are still reading their tokens
        wait = min(max(GATHER_S, 2 * self.step_s), self.max_wait) if passes >= self.stages else GATHER_S
        if self.wake_at is None or now + wait < self.wake_at:  # (never postponed)
            self.wake_at = now + wait
        return out

    def _launch(self, n: int) -> list[Pass[K]]:
        group, self.ready = self.ready[:n], self.ready[n:]
        if not self.ready:
            self.wake_at = None
        self._ids += 1
        p = Pass(self._ids, group)
        self.computing = p.id
        for step in group:
            self.sending[step.session] = p.id
        return [p]
