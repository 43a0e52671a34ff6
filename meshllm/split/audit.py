"""Output integrity of split chains: audits by recomputation, stage records, and who lied (sans-IO).

A worker the coordinator placed could return tokens of its choosing, or forward activations it made
up. The coordinator holds the whole model file, so it can check a finished request afterwards: it
recomputes the request range by range from its own file (:func:`audit_ranges`, within a memory
bound) on exactly the schedule the chain ran (:func:`schedule`: the prompt in the lane's prefill
chunks, then one position per generated token, as Decodes and Verify windows compute them), and
judges every returned token against the recomputed logits (:class:`TokenChecker`: greedy tokens
must be the argmax within :data:`LOGIT_EPS`, sampled tokens the seeded draw). On this machine the
recomputation is bit for bit what the chain computed (0.0 difference on the default model and on
float32 and Q8_0 tiny models, ``bench/audit.py``; as one prefill instead, the default model's logits
move by 5.1 and its argmax changes); the tolerances cover another CPU's accumulation order.

When an audit fails, every worker of the chain is asked for its :class:`StageRecord` of the
session: the input rows it received and the output rows (the last stage: the tokens) it produced,
kept for a short while after the session (:class:`Recorder`), signed with its node key.
:func:`attribute` walks the chain from the coordinator: a stage whose record shows the honest input
but an output other than the recomputation is *proven* a forger (its own signed record is the
evidence: anyone with the model file can recompute its layers on its input); a stage whose recorded
input differs from what the previous stage recorded sending makes a *dispute* (one of the two lies,
and without signed frames the coordinator cannot tell which: both are evicted); a last stage whose
record differs from the tokens the coordinator received, a stage with no valid record, or one whose
first input differs from what the coordinator itself sent, *lied* to the coordinator.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Annotated, Literal

import msgspec
import numpy as np
from msgspec import Meta

from meshllm.engine.sampler import Sampler
from meshllm.split.frames import Hop, Sampling, SessionId

AUDIT_RATE = 0.05
"""Share of split requests audited by default (plus the first request of every new chain)."""
AUDIT_MEMORY = 1 << 30
"""Bytes one audit's loaded layers may hold at once (weights, KV and compute buffers of a range)."""
LOGIT_EPS = 0.01
"""A greedy token is accepted when its logit is within this of the maximum (same-CPU recomputation: 0)."""
ROW_RTOL = 1e-3
"""Activation rows agree when they differ by at most this times the row's largest magnitude (plus it)."""
PROBATION = 8
"""Audits a worker node must pass before requests through it are drawn at a rate: until then every
request through it is audited (and the first of every chain, whatever its nodes' history)."""
MAX_PENDING = 4
"""Finished requests waiting for an audit; beyond it new ones are dropped (and counted)."""

KIND = "stage-audit"
"""Stream kind of record queries (coordinator -> worker)."""
DOMAIN = "split-record"
"""Signature domain of a :class:`StageRecord`."""
RECORD_TTL_S = 120.0
"""How long a worker keeps a session's record after its last step."""
RECORD_SESSION_BYTES = 16 << 20
"""Largest record kept for one session (rows beyond it are not recorded: such a session cannot be attributed)."""
RECORD_TOTAL_BYTES = 64 << 20
"""All records a worker keeps together (oldest dropped first)."""
AUDIT_FRAME_MAX = 2 * RECORD_SESSION_BYTES + 64 * 1024
"""Largest audit stream frame (a signed record with its rows)."""


# -- the schedule and the ranges -----------------------------------------------------------------


def schedule(n_prompt: int, n_fed: int, chunk: int) -> list[tuple[int, int]]:
    """``(start, end)`` of each forward call the chain made: prompt chunks, then one call per position.

    A multi-row forward uses other kernels than a one-row one, so a recomputation only reproduces
    the chain's numbers when it calls the layers on the same row groups.
    """
    calls = [(s, min(s + chunk, n_prompt)) for s in range(0, n_prompt, chunk)]
    return calls + [(p, p + 1) for p in range(n_prompt, n_fed)]


def audit_ranges(chain: Sequence[Hop], cost: Callable[[int, int], int], bound: int) -> list[tuple[int, int]]:
    """Layer ranges to recompute one after another: each chain stage, cut so ``cost(start, end) <= bound``.

    Ranges never cross a stage boundary (the recomputation keeps each stage's output for
    attribution); a single layer over the bound is still one range (the bound cannot go below it).
    """
    out = []
    for hop in chain:
        start = hop.layer_start
        while start < hop.layer_end:
            end = start + 1
            while end < hop.layer_end and cost(start, end + 1) <= bound:
                end += 1
            out.append((start, end))
            start = end
    return out


# -- judging tokens ------------------------------------------------------------------------------


class TokenChecker:
    """Judges a request's tokens one position at a time, with the last stage's sampler state.

    The history starts as the Open's (the prompt when penalties are on) and every judged token is
    appended, as the last stage does; a sampled position consumes one draw of the seeded stream.
    """

    def __init__(self, sampling: Sampling, prompt: Sequence[int], eps: float = LOGIT_EPS) -> None:
        penalties = sampling.repeat_penalty != 1.0 or sampling.presence_penalty or sampling.frequency_penalty
        self.sampler = Sampler(sampling, step=sampling.step)
        self.history = list(prompt) if penalties else []
        self.eps = eps
        self.judged = 0
        self.first_bad: int | None = None
        """Index (in the request's tokens) of the first token that is not the recomputation's."""
        self.expected: int | None = None
        """What the recomputation produces at ``first_bad``."""

    def check(self, logits: np.ndarray, token: int) -> bool:
        ok, expected = self.sampler.judge(logits, self.history, token, self.eps)
        if not ok and self.first_bad is None:
            self.first_bad, self.expected = self.judged, expected
        self.history.append(token)
        self.judged += 1
        return ok


def rows_close(a: np.ndarray, b: np.ndarray, rtol: float = ROW_RTOL) -> bool:
    """Whether two activation row blocks agree within ``rtol`` of their largest magnitude."""
    if a.shape != b.shape:
        return False
    scale = float(np.abs(b).max(initial=0.0)) + 1.0
    return bool(np.abs(a - b).max(initial=0.0) <= rtol * scale)


# -- stage records ---------------------------------------------------------------------------------


class StageRecord(msgspec.Struct, frozen=True, kw_only=True):
    """What a stage received and produced for one session, signed by it (domain :data:`DOMAIN`)."""

    model: Annotated[str, Meta(max_length=200)]
    session: SessionId
    coordinator: Annotated[str, Meta(max_length=128)]
    layer_start: Annotated[int, Meta(ge=0, le=4096)]
    layer_end: Annotated[int, Meta(ge=0, le=4096)]
    width: Annotated[int, Meta(ge=1, le=1 << 16)]
    positions: Annotated[int, Meta(ge=0, le=1 << 24)]
    """Rows recorded: positions 0 .. positions-1."""
    inputs: bytes
    """float32 ``[positions, width]`` as received (decoded)."""
    outputs: bytes = b""
    """float32 ``[positions, width]`` as forwarded (empty on the last stage)."""
    tokens: list[Annotated[int, Meta(ge=0, lt=1 << 31)]] = []
    """The last stage: every token it sampled, in order."""
    complete: bool = True
    """False when the session outgrew :data:`RECORD_SESSION_BYTES` and later rows were not kept."""

    def rows(self, which: Literal["inputs", "outputs"]) -> np.ndarray:
        return np.frombuffer(getattr(self, which), dtype=np.float32).reshape(-1, self.width)


class AuditQuery(msgspec.Struct, frozen=True, kw_only=True, tag="audit-query"):
    """Coordinator -> worker: your record of ``session`` on your stage of ``model``."""

    model: Annotated[str, Meta(min_length=1, max_length=200)]
    session: SessionId


class AuditRecord(msgspec.Struct, frozen=True, kw_only=True, tag="audit-record"):
    """The record (msgpack :class:`StageRecord`) and the worker's signature over it."""

    body: Annotated[bytes, Meta(max_length=AUDIT_FRAME_MAX)]
    signature: Annotated[bytes, Meta(min_length=64, max_length=64)]


class AuditRefused(msgspec.Struct, frozen=True, kw_only=True, tag="audit-refused"):
    message: Annotated[str, Meta(max_length=500)]


AuditReply = AuditRecord | AuditRefused


class BadRecord(ValueError):
    """A record that is not signed by its stage, not about the asked session, or malformed."""


def check_record(record: StageRecord, *, model: str, session: str, coordinator: str, hop: Hop, width: int,
                 last: bool) -> None:
    """Validate a decoded record against what the coordinator asked; :class:`BadRecord` if it does not fit."""
    if (record.model, record.session, record.coordinator) != (model, session, coordinator):
        raise BadRecord("the record is about another session")
    if (record.layer_start, record.layer_end) != (hop.layer_start, hop.layer_end):
        raise BadRecord(f"the record is for layers [{record.layer_start}, {record.layer_end})")
    if record.width != width:
        raise BadRecord(f"the record's rows are {record.width} wide, the model's {width}")
    rows = 4 * record.positions * width
    if len(record.inputs) != rows or len(record.outputs) != (0 if last else rows):
        raise BadRecord("the record's rows do not match its positions")
    if not last and record.tokens:
        raise BadRecord("only the last stage records tokens")


# -- attribution ---------------------------------------------------------------------------------

VerdictKind = Literal["forged", "lied", "dispute", "unaccountable", "unattributed"]
EXPIRED = "expired"
"""In place of a record asked for after workers may have dropped it (:data:`RECORD_TTL_S`): not judged."""


@dataclass(frozen=True)
class Verdict:
    """Who to evict after a failed audit: chain indexes (never 0, the coordinator), and why."""

    stages: tuple[int, ...]
    kind: VerdictKind
    reason: str


def attribute(*, honest: Sequence[np.ndarray], received: Sequence[int], records: Sequence[StageRecord | str],
              first_bad: int, n_prompt: int) -> Verdict:
    """The stage(s) that made a failed audit fail.

    ``honest[i]`` is the recomputed output of stage ``i`` for ``i < S - 1`` (stage 0's is what the
    coordinator sent), over the positions the request fed; ``received`` the tokens the coordinator
    got; ``records[i - 1]`` stage ``i``'s checked record or why there is none; ``first_bad`` the
    index of the first received token the recomputation does not produce.

    Each stage is judged on its own record against the recomputation, so one stage's missing or
    lying record does not hide another's forgery: a stage whose input is the honest one must show
    the honest output; a stage whose input is not must show what the previous stage records sending.
    The verdict names every stage found at fault; its kind and the reason start with the first.
    """
    n = honest[0].shape[0] if honest else 0
    last = len(records)
    found: list[tuple[tuple[int, ...], VerdictKind, str]] = []
    for i, record in enumerate(records, start=1):
        if record == EXPIRED:
            continue
        if isinstance(record, str):
            found.append(((i,), "unaccountable", f"stage {i} gave no valid record: {record}"))
            continue
        if record.positions < n:
            if record.complete:
                found.append(((i,), "unaccountable", f"stage {i} recorded {record.positions} of its {n} positions"))
            continue  # a session too long to record: this stage cannot be judged
        if not rows_close(record.rows("inputs")[:n], honest[i - 1]):
            before = records[i - 2] if i > 1 else None
            if before is None:
                found.append(((1,), "lied", "stage 1 records an input other than the coordinator sent"))
            elif isinstance(before, StageRecord) and before.positions >= n and not rows_close(
                    record.rows("inputs")[:n], before.rows("outputs")[:n]):
                found.append(((i - 1, i), "dispute",
                              f"stage {i} records an input other than stage {i - 1} records sending"))
            continue  # fed a wrong input by the stage before it (judged there): its output cannot be judged
        if i < last:
            outputs = record.rows("outputs")[:n]
            if not rows_close(outputs, honest[i]):
                found.append(((i,), "forged", f"stage {i}'s output at position {_first_bad_row(outputs, honest[i])} "
                                              "is not its layers' output for the input it records"))
        elif list(record.tokens[: len(received)]) != list(received):
            found.append(((i,), "lied", "the last stage records other tokens than it sent"))
        else:
            found.append(((i,), "forged", f"the last stage's token {first_bad} (position {n_prompt - 1 + first_bad}) "
                                          "is not what its layers give for the input it records"))
    if not found:
        return Verdict(tuple(range(1, last + 1)), "unattributed", "no stage's record explains the failed audit")
    stages = tuple(sorted({s for f in found for s in f[0]}))
    return Verdict(stages, found[0][1], "; ".join(f[2] for f in found))


def _first_bad_row(got: np.ndarray, want: np.ndarray) -> int:
    for p in range(got.shape[0]):
        if not rows_close(got[p : p + 1], want[p : p + 1]):
            return p
    return -1


# -- what a worker keeps ---------------------------------------------------------------------------


@dataclass
class _Kept:
    coordinator: str
    model: str
    layers: tuple[int, int]
    width: int
    last: bool
    inputs: list[np.ndarray] = field(default_factory=list)
    outputs: list[np.ndarray] = field(default_factory=list)
    tokens: list[tuple[int, int]] = field(default_factory=list)
    """(position whose logits gave it, token)."""
    positions: int = 0
    complete: bool = True
    touched: float = 0.0

    nbytes: int = 0
    """Bytes of the kept rows."""

    def append(self, inputs: np.ndarray, outputs: np.ndarray | None) -> None:
        self.inputs.append(inputs)
        self.nbytes += inputs.nbytes
        if outputs is not None:
            self.outputs.append(outputs)
            self.nbytes += outputs.nbytes

    def trim(self, pos: int) -> None:
        """Drop rows at ``pos`` and beyond (a Verify window's rejected positions): only the last chunks change."""
        if pos >= self.positions:
            return
        for rows in (self.inputs, self.outputs):
            end = self.positions  # the rows of both lists cover positions 0 .. positions-1
            while rows and end - len(rows[-1]) >= pos:
                end -= len(rows[-1])
                self.nbytes -= rows.pop().nbytes
            if rows and end > pos:
                keep = rows[-1][: len(rows[-1]) - (end - pos)].copy()
                self.nbytes -= rows[-1].nbytes - keep.nbytes
                rows[-1] = keep
        self.tokens = [(p, t) for p, t in self.tokens if p < pos]
        self.positions = pos


class Recorder:
    """Per session, the rows a stage received and produced (and the tokens it sampled), bounded.

    Kept for :data:`RECORD_TTL_S` after a session's last step, at most :data:`RECORD_SESSION_BYTES`
    per session and :data:`RECORD_TOTAL_BYTES` in all (the least recently touched goes first).
    """

    def __init__(self, *, ttl_s: float = RECORD_TTL_S, session_bytes: int = RECORD_SESSION_BYTES,
                 total_bytes: int = RECORD_TOTAL_BYTES, clock: Callable[[], float] = time.monotonic) -> None:
        self.ttl_s, self.session_bytes, self.total_bytes = ttl_s, session_bytes, total_bytes
        self.clock = clock
        self._kept: OrderedDict[str, _Kept] = OrderedDict()
        self._bytes = 0

    def start(self, session: str, *, coordinator: str, model: str, layers: tuple[int, int], width: int,
              last: bool) -> None:
        """A session opened on this stage (replaces an older record of the same id)."""
        self._drop(session)
        self._kept[session] = _Kept(coordinator, model, layers, width, last, touched=self.clock())
        self._expire()

    def record(self, session: str, pos: int, inputs: np.ndarray, outputs: np.ndarray | None,
               tokens: Sequence[int] = (), *, window: bool = False) -> None:
        """A step at ``pos``: the input rows it computed, its output rows (not on the last stage), its tokens.

        On the last stage the ``k``-th token of a window came from position ``pos + k``; a single
        sample from the step's final position.
        """
        kept = self._kept.get(session)
        if kept is None:
            return
        kept.touched = self.clock()
        self._kept.move_to_end(session)
        before = kept.nbytes
        kept.trim(pos)
        rows = np.array(inputs, np.float32)
        if pos != kept.positions or not kept.complete or kept.nbytes + 2 * rows.nbytes > self.session_bytes:
            kept.complete = False  # a gap, or too long to keep: what is kept stays, but cannot be judged whole
        else:
            kept.append(rows, np.array(outputs, np.float32) if outputs is not None and not kept.last else None)
            start = pos if window else pos + len(rows) - 1
            kept.tokens += [(start + k, int(t)) for k, t in enumerate(tokens)]
            kept.positions = pos + len(rows)
        self._bytes += kept.nbytes - before
        self._expire()

    def step(self, session: str, pos: int, inputs: np.ndarray, out: np.ndarray | list[int], *, window: bool) -> None:
        """A stage step as :class:`~meshllm.split.stage.StageServer` ran it: ``out`` is rows, or the sampled tokens.

        A last stage's window computes only the positions up to its first rejected draft.
        """
        kept = self._kept.get(session)
        if kept is None:
            return
        if isinstance(out, list):
            self.record(session, pos, inputs[: len(out)] if window else inputs, None, out, window=window)
        else:
            self.record(session, pos, inputs, None if kept.last else out)

    def get(self, session: str, coordinator: str) -> StageRecord | None:
        """The record of ``session`` if ``coordinator`` is the one that opened it."""
        self._expire()
        kept = self._kept.get(session)
        if kept is None or kept.coordinator != coordinator:
            return None
        def flat(rows: list[np.ndarray]) -> bytes:
            return np.concatenate(rows).astype(np.float32).tobytes() if rows else b""
        return StageRecord(model=kept.model, session=session, coordinator=kept.coordinator,
                           layer_start=kept.layers[0], layer_end=kept.layers[1], width=kept.width,
                           positions=kept.positions, inputs=flat(kept.inputs),
                           outputs=b"" if kept.last else flat(kept.outputs), tokens=[t for _, t in kept.tokens],
                           complete=kept.complete)

    @property
    def nbytes(self) -> int:
        return self._bytes

    def _drop(self, session: str) -> None:
        kept = self._kept.pop(session, None)
        if kept is not None:
            self._bytes -= kept.nbytes

    def _expire(self) -> None:
        now = self.clock()
        while self._kept:
            session, oldest = next(iter(self._kept.items()))
            if oldest.touched + self.ttl_s > now and self._bytes <= self.total_bytes:
                break
            self._drop(session)


# -- counters --------------------------------------------------------------------------------------


class AuditPolicy:
    """Which finished requests to audit, by the history of the chain's worker nodes (sans-IO).

    A node's audit probability is 1 until it has passed :data:`PROBATION` audits, then
    ``PROBATION / passes``, down to the base ``rate`` (``rate`` 0: no audits at all). A request is
    audited with the highest probability among its chain's workers, so a new or rebuilt chain with
    one unknown node is audited on every request until that node has passed its probation, and a
    node that earned trust slowly keeps a high rate for long: at the default 5 %, only after 160
    passed audits. A forger honest for its first ``h`` requests is caught, on average, at its
    ``1 / p(h)``-th forged answer (``bench/audit_policy.py``).
    """

    def __init__(self, rate: float, probation: int = PROBATION, size: int = 4096) -> None:
        self.rate = rate
        self.probation = probation
        self._passed: OrderedDict[str, int] = OrderedDict()
        self._size = size

    def passed(self, node: str) -> int:
        return self._passed.get(node, 0)

    def probability(self, nodes: Sequence[str]) -> float:
        """Chance that a request through ``nodes`` (the chain's workers) is audited."""
        if self.rate <= 0:
            return 0.0
        return max((self._node(self.passed(n)) for n in nodes), default=self.rate)

    def _node(self, passes: int) -> float:
        if passes < self.probation:
            return 1.0
        return max(self.rate, min(1.0, self.probation / passes))

    def record_pass(self, nodes: Sequence[str]) -> None:
        """An audit of a request through ``nodes`` passed: each has one more in its history."""
        for node in nodes:
            self._passed[node] = self._passed.get(node, 0) + 1
            self._passed.move_to_end(node)
        while len(self._passed) > self._size:
            self._passed.popitem(last=False)

    def forget(self, nodes: Sequence[str]) -> None:
        """``nodes`` failed an audit (or were evicted): they start again without history."""
        for node in nodes:
            self._passed.pop(node, None)


@dataclass
class AuditCounters:
    """``/api/status`` ``splits[].audits``."""

    rate: float
    run: int = 0
    passed: int = 0
    failed: int = 0
    dropped: int = 0
    pending: int = 0
    last_ms: float | None = None
    """How long the latest audit's recomputation took (ms)."""
    total_ms: float = 0.0
    """Recomputation time of every audit so far (ms): ``total_ms / run`` is the mean cost."""
    last_ranges: int | None = None
    """Layer ranges the latest audit loaded one after another (more than the stages: the memory bound cut them)."""

    def status(self) -> dict[str, object]:
        return {"rate": self.rate, "run": self.run, "passed": self.passed, "failed": self.failed,
                "dropped": self.dropped, "pending": self.pending, "last_ms": self.last_ms,
                "total_ms": round(self.total_ms, 3),
                "last_ranges": self.last_ranges}
