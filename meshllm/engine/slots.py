"""The llama.cpp engine's slot scheduler (sans-IO): which requests hold slots, what each step computes.

The engine owns one llama.cpp context of ``n_slots`` sequences. Every step, :meth:`Scheduler.plan`
returns:

1. **assignments**: waiting requests that get a free slot, the request whose client holds the fewest
   slots first (then the client served longest ago, then the oldest request), and the slot whose
   cached prompt it can reuse most of (:func:`meshllm.engine.prompt_cache.reusable`), else one next to
   the busy slots (a decode batch covers consecutive slots), an empty one, the least recently used;
2. **decode rows**: one per generating slot, its last sampled token;
3. **prefill chunks** on the fixed grid, the prefilling slots taking turns, at most ``chunk`` tokens
   in all (but always one chunk): a long prompt holds the generating slots up for one chunk at a
   time, and a short prompt waits for at most one chunk of each long one.

The driver runs the step on llama.cpp and reports back (:meth:`prefilled`, :meth:`decoded`,
:meth:`sampled`, :meth:`release`). The waiting queue is a :class:`~meshllm.engine.fair_queue.FairQueue`:
bounded, shared fairly between clients (:meth:`submit` returns the requests a newcomer displaced).
Nothing here touches llama.cpp, threads or clocks; time is passed in.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from meshllm.engine.fair_queue import FairQueue
from meshllm.engine.prompt_cache import grid_end, reusable

J = TypeVar("J")


@dataclass(eq=False)
class Slot(Generic[J]):
    """One sequence of the context: the KV it holds and the request using it."""

    index: int
    cached: list[int] = field(default_factory=list)
    """Token ids whose KV the sequence holds, in position order."""
    exact: int = 0
    """Leading ``cached`` tokens computed as whole grid chunks of a prefill: what may be lent."""
    job: J | None = None
    client: str = ""
    target: tuple[int, ...] = ()
    """Tokens the request needs in the KV before its first sample (prompt + continuation)."""
    next_token: int | None = None
    """The last sampled token, to be decoded in the next step."""
    turn: int = 0
    """When the slot last had a prefill chunk planned (prefilling slots take turns)."""
    touched: int = 0
    """When the slot was last assigned or released (least recently used goes first)."""

    @property
    def prefilling(self) -> bool:
        return self.job is not None and len(self.cached) < len(self.target)


@dataclass(frozen=True)
class Assignment(Generic[J]):
    """A waiting request moves into ``slot``, keeping the first ``reused`` tokens of its KV."""

    job: J
    slot: int
    reused: int


@dataclass(frozen=True)
class DecodeRow:
    """Decode ``token`` at ``pos`` in ``slot``."""

    slot: int
    token: int
    pos: int


@dataclass(frozen=True)
class Chunk:
    """Prefill ``tokens`` at positions ``start..`` of ``slot``; ``last``: the logits give the first sample."""

    slot: int
    start: int
    tokens: tuple[int, ...]
    last: bool


@dataclass(frozen=True)
class Step(Generic[J]):
    """What to compute now."""

    assigned: list[Assignment[J]]
    decode: list[DecodeRow]
    prefill: list[Chunk]

    @property
    def empty(self) -> bool:
        return not (self.assigned or self.decode or self.prefill)


@dataclass(eq=False)
class _Waiting(Generic[J]):
    job: J
    tokens: tuple[int, ...]
    client: str


class Scheduler(Generic[J]):
    """Slots, the fair waiting queue and the step plan of one engine."""

    def __init__(self, n_slots: int, *, chunk: int, max_queue: int, reuse: bool = True) -> None:
        """``reuse``: a request may keep a slot's cached prefix (not for a model whose state cannot be cut
        back to a prefix: recurrent layers)."""
        if n_slots < 1 or chunk < 1 or max_queue < 0:
            raise ValueError("need at least one slot, a positive chunk and a queue bound")
        self.reuse = reuse
        self.slots: list[Slot[J]] = [Slot(i) for i in range(n_slots)]
        self.chunk = chunk
        self.max_queue = max_queue
        self._waiting: FairQueue[_Waiting[J]] = FairQueue(max_queue)
        self._seq = 0

    # ---- load ------------------------------------------------------------------------------

    @property
    def running(self) -> int:
        return sum(1 for s in self.slots if s.job is not None)

    @property
    def queued(self) -> int:
        return len(self._waiting)

    @property
    def idle(self) -> bool:
        return not self._waiting and self.running == 0

    # ---- the queue -------------------------------------------------------------------------

    def submit(self, job: J, tokens: tuple[int, ...], client: str, now: float) -> list[J]:
        """Queue ``job``; return the jobs it displaced. Raises :class:`~meshllm.engine.fair_queue.QueueFull`."""
        if not tokens:
            raise ValueError("a request needs at least one token to prefill")
        return [w.job for w in self._waiting.push(_Waiting(job, tokens, client), client, now)]

    def expired(self, now: float, timeout_s: float) -> list[J]:
        """Remove and return the jobs that waited longer than ``timeout_s``."""
        return [w.job for w in self._waiting.expired(now, timeout_s)]

    def cancel(self, job: J) -> int | None:
        """Forget ``job``: out of the queue, or out of its slot (whose index is returned)."""
        for w in self._waiting:
            if w.job is job:
                self._waiting.remove(w)
                return None
        for slot in self.slots:
            if slot.job is job:
                self.release(slot.index)
                return slot.index
        return None

    # ---- the plan --------------------------------------------------------------------------

    def plan(self) -> Step[J]:
        """Assign free slots to waiting jobs, then list this step's decode rows and prefill chunks."""
        assigned: list[Assignment[J]] = []
        while self._waiting and any(s.job is None for s in self.slots):
            assigned.append(self._assign(self._next_waiting()))
        decode = [DecodeRow(s.index, s.next_token, len(s.cached)) for s in self.slots
                  if s.job is not None and s.next_token is not None]
        prefill: list[Chunk] = []
        budget = self.chunk
        for slot in sorted((s for s in self.slots if s.prefilling), key=lambda s: (s.turn, s.index)):
            start = len(slot.cached)
            end = grid_end(start, len(slot.target), self.chunk)
            if prefill and end - start > budget:
                break
            prefill.append(Chunk(slot.index, start, slot.target[start:end], end == len(slot.target)))
            budget -= end - start
            self._seq += 1
            slot.turn = self._seq
        return Step(assigned, decode, prefill)

    def _next_waiting(self) -> _Waiting[J]:
        return self._waiting.pop(Counter(s.client for s in self.slots if s.job is not None))

    def _assign(self, w: _Waiting[J]) -> Assignment[J]:
        free = [s for s in self.slots if s.job is None]
        reuse = {s.index: reusable(s.cached, s.exact, w.tokens, self.chunk) if self.reuse else 0 for s in free}
        best = max(reuse.values())
        if best > 0:
            slot = next(s for s in free if reuse[s.index] == best)
        else:  # no reuse: next to the busy slots (one batch covers only consecutive ones), then an empty
            busy = [s.index for s in self.slots if s.job is not None]  # slot, then the least recently used

            def gaps(s: Slot[J]) -> int:
                span = [*busy, s.index]
                return max(span) - min(span) + 1 - len(span)

            slot = min(free, key=lambda s: (gaps(s), bool(s.cached), s.touched, s.index))
        self._seq += 1
        keep = reuse[slot.index]
        slot.job, slot.client, slot.target = w.job, w.client, w.tokens
        slot.cached, slot.exact = slot.cached[:keep], keep
        slot.next_token, slot.turn, slot.touched = None, 0, self._seq
        return Assignment(w.job, slot.index, keep)

    # ---- what the driver reports ------------------------------------------------------------

    def prefilled(self, chunk: Chunk) -> None:
        """``chunk`` is in the KV."""
        slot = self.slots[chunk.slot]
        slot.cached.extend(chunk.tokens)
        whole = len(chunk.tokens) == self.chunk and chunk.start % self.chunk == 0
        if whole and slot.exact == chunk.start:
            slot.exact = chunk.start + self.chunk

    def sampled(self, index: int, token: int) -> None:
        """The slot's request continues with ``token`` (decoded in the next step)."""
        self.slots[index].next_token = token

    def decoded(self, index: int, drafts: Sequence[int] = ()) -> None:
        """The slot's last sampled token is in the KV, and after it the ``drafts`` a window kept."""
        slot = self.slots[index]
        assert slot.next_token is not None
        slot.cached.append(slot.next_token)
        slot.cached.extend(drafts)
        slot.next_token = None

    def release(self, index: int) -> None:
        """The slot's request ended; its KV stays as a cache for the next ones."""
        slot = self.slots[index]
        self._seq += 1
        slot.job, slot.client, slot.target, slot.next_token, slot.touched = None, "", (), None, self._seq

    def forget(self, index: int) -> None:
        """The slot's KV can no longer be trusted (a failed call): nothing of it will be lent."""
        self.slots[index].cached, self.slots[index].exact = [], 0


class CallCosts:
    """Recent seconds per decode call by its row count: is one batch of ``n`` rows, or ``n`` calls of one
    row, faster right now?

    On a CPU a one-row call streams the weights once (bandwidth-bound) while a call of a few rows is
    compute-bound in kernels tuned for larger batches: on the default model at one thread, 2 rows in
    one call took 48 ms against 2 x 18 ms alone, and 8 rows 90 ms against 8 x 18. Which wins depends on
    the model, the threads and the load, so it is measured as the engine runs: each call's duration
    feeds an exponential average per row count, and a batch is split only once both figures are
    known and the singles are cheaper; a split batch is tried whole again every ``reprobe`` steps.
    """

    ALPHA = 0.2

    def __init__(self, reprobe: int = 50) -> None:
        self.reprobe = reprobe
        self._seconds: dict[int, float] = {}
        self._split_runs: defaultdict[int, int] = defaultdict(int)

    def observe(self, rows: int, seconds: float) -> None:
        """A call of ``rows`` rows took ``seconds``."""
        old = self._seconds.get(rows)
        self._seconds[rows] = seconds if old is None else (1 - self.ALPHA) * old + self.ALPHA * seconds

    def seconds(self, rows: int) -> float | None:
        """Expected seconds of a call of ``rows`` rows: its measured average, else a straight line
        through the nearest measured counts on either side (or the two nearest on one side); ``None``
        before two counts are measured.

        Beyond the measured counts the line is held between what the nearest count bounds: a call of
        fewer rows costs no more than it and no less per row (a row's share of a call only shrinks as
        the call widens), a call of more rows the reverse. Two noisy figures (a first call's graph
        set-up) would otherwise extend to a free call, and a replay priced at zero seconds is decoded
        one row per step however long that takes."""
        if rows in self._seconds:
            return self._seconds[rows]
        known = sorted(self._seconds)
        if len(known) < 2:
            return None
        below = [n for n in known if n < rows][-2:]
        above = [n for n in known if n > rows][:2]
        a, b = (below[-1], above[0]) if below and above else ((below or above)[0], (below or above)[1])
        ta, tb = self._seconds[a], self._seconds[b]
        line = ta + (tb - ta) * (rows - a) / (b - a)
        if below and above:
            return line
        edge = known[0] if above else known[-1]
        scaled = self._seconds[edge] * rows / edge
        return min(max(line, scaled), self._seconds[edge]) if above else min(max(line, self._seconds[edge]), scaled)

    def split(self, rows: int) -> bool:
        """Whether ``rows`` one-row calls are expected to be faster than one call of ``rows`` rows."""
        one, many = self._seconds.get(1), self._seconds.get(rows)
        if rows < 2 or one is None or many is None or rows * one >= many:
            return False
        self._split_runs[rows] += 1
        if self._split_runs[rows] >= self.reprobe:  # measure the batch again: the load may have changed
            self._split_runs[rows] = 0
            return False
        return True
