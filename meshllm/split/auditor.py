"""Audits of split requests: the coordinator's recomputation in a low-priority thread, and the record queries.

The sans-IO parts (schedule, ranges, token checks, records, attribution) are in
:mod:`meshllm.split.audit`. Here the coordinator side (:class:`Auditor`) takes finished requests
from the :class:`~meshllm.split.engine.SplitEngine` (a share of them, and the first of every new
chain), queues at most :data:`~meshllm.split.audit.MAX_PENDING` (more are dropped and counted),
recomputes each in one dedicated thread at the lowest CPU priority from the node's own copy of the
model (:func:`recompute`: one range loaded at a time, within the memory bound), and, when a token is
not the recomputation's, asks every worker of the chain for its signed record over a
``stage-audit`` stream, names the stage(s) that lied (:func:`~meshllm.split.audit.attribute`) and
has the placement evict them. The worker side (:func:`serve_records`) answers only the coordinator
that opened the session.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import os
import random
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec
import numpy as np
from nacl.signing import SigningKey

from meshllm.engine.ggml import StageModel
from meshllm.engine.ggml.hparams import read_hparams
from meshllm.engine.kernels import Kernels
from meshllm.errors import DecodeError, MeshllmError
from meshllm.identity.ids import node_public_key, short
from meshllm.identity.signing import sign_bytes, verify_bytes
from meshllm.models.gguf_file import GGUFFile
from meshllm.net import Endpoint, NetError, PeerConnection, Stream
from meshllm.split.audit import (
    AUDIT_FRAME_MAX,
    AUDIT_MEMORY,
    AUDIT_RATE,
    DOMAIN,
    EXPIRED,
    KIND,
    MAX_PENDING,
    RECORD_TTL_S,
    AuditCounters,
    AuditPolicy,
    AuditQuery,
    AuditRecord,
    AuditRefused,
    AuditReply,
    BadRecord,
    Recorder,
    StageRecord,
    TokenChecker,
    Verdict,
    attribute,
    audit_ranges,
    check_record,
    schedule,
)
from meshllm.split.control import stage_memory
from meshllm.split.coordinator import SplitCoordinator
from meshllm.split.frames import Hop, Sampling
from meshllm.tasks import Scope
from meshllm.wire.addr import parse_addr

if TYPE_CHECKING:
    from meshllm.split.placement import SplitPlacement

log = logging.getLogger(__name__)

QUERY_TIMEOUT_S = 10.0
"""Longest wait for a worker's record (it is in memory: anything slower is a worker that will not answer)."""


@dataclass(frozen=True)
class FinishedRequest:
    """What a split request fed the chain and what came back: the input of an audit.

    Split engines hand activations over as float32 (the exact codec), which is what records and
    recomputation compare; the lossy codecs (f16, i8) are not audited.
    """

    session: str
    prompt: list[int]
    tokens: list[int]
    """Every token the chain returned that the request consumed, in order."""
    sampling: Sampling
    finished: float = field(default_factory=time.monotonic)
    """When the request ended: workers keep its records for :data:`~meshllm.split.audit.RECORD_TTL_S` after."""


@dataclass
class Recomputation:
    """The honest run of a request: each stage's output but the last's, and the token verdict."""

    honest: list[np.ndarray]
    first_bad: int | None
    expected: int | None
    ranges: list[tuple[int, int]]
    seconds: float


Loader = Callable[[Path, int, int, int], StageModel]


def recompute(path: Path, chain: Sequence[Hop], request: FinishedRequest, *, chunk: int, context: int,
              bound: int = AUDIT_MEMORY, load: Loader | None = None) -> Recomputation:
    """Run ``request`` through the model at ``path`` range by range, as the chain ran it (blocking).

    One range's layers are loaded at a time (``bound`` bytes at most, :func:`audit_ranges`) and freed
    before the next; between ranges only the activations travel (``positions x width`` floats).
    ``chunk`` is the lane's prefill chunk and ``context`` the chain's session context: the KV view a
    step attends over depends on it, and with it the arithmetic.
    """
    started = time.perf_counter()
    load = load or (lambda p, a, b, ctx: StageModel.load(p, a, b, max_context=ctx, threads=1, gpu_layers=0))
    reader = GGUFFile(path)
    hp = read_hparams(reader)
    prompt, tokens = request.prompt, request.tokens
    fed = [*prompt, *tokens[:-1]]
    n, n_prompt = len(fed), len(prompt)
    calls = schedule(n_prompt, n, chunk)
    ranges = audit_ranges(chain, lambda a, b: stage_memory(reader, a, b, min(context, n + 1)), bound)
    ends = {hop.layer_end for hop in chain[:-1]}
    checker = TokenChecker(request.sampling, prompt)
    x: np.ndarray = np.asarray(fed, dtype=np.int64)
    honest: list[np.ndarray] = []
    for start, end in ranges:
        stage = load(path, start, end, context)
        try:
            if end == hp.n_layers:
                for s, e in calls:
                    logits = stage.forward("audit", x[s:e], s, last_only=True)[-1]
                    if e >= n_prompt:
                        checker.check(logits, tokens[e - n_prompt])
                continue
            x = np.concatenate([stage.forward("audit", x[s:e], s) for s, e in calls])
        finally:
            stage.close()
        if end in ends:
            honest.append(x)
    return Recomputation(honest, checker.first_bad, checker.expected, ranges, time.perf_counter() - started)


def _lower_priority() -> None:
    """The audit thread (and the ggml threads it starts) at the lowest CPU priority: serving comes first."""
    with contextlib.suppress(OSError, AttributeError):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)


@dataclass
class _Job:
    placement: SplitPlacement
    coordinator: SplitCoordinator
    request: FinishedRequest
    queued: float = field(default_factory=time.monotonic)


class Auditor:
    """The coordinator side of audits for every split model of a node."""

    def __init__(self, endpoint: Endpoint, *, rate: float = AUDIT_RATE, memory: int = AUDIT_MEMORY,
                 kernels: Kernels = "exact", publish: Callable[..., Any] | None = None,
                 seed: int | None = None) -> None:
        """``seed`` fixes which requests are drawn (benchmarks); None draws from the OS's entropy."""
        self.endpoint = endpoint
        self.rate = rate
        self.memory = memory
        self.kernels: Kernels = kernels
        self.publish = publish or (lambda *_a, **_k: None)
        self.counters: dict[str, AuditCounters] = {}
        self._queue: asyncio.Queue[_Job] = asyncio.Queue(MAX_PENDING)
        self._seen: weakref.WeakSet[SplitCoordinator] = weakref.WeakSet()
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="split-audit", initializer=_lower_priority)
        self._scope = Scope("split audits")
        """The audit loop, started with the first audit."""
        self._running = False
        self._random = random.Random(seed)
        self.policy = AuditPolicy(rate)
        """Who has passed how many audits: requests through nodes without history are all audited."""

    def status(self, model: str) -> dict[str, object]:
        return self._counters(model).status()

    def _counters(self, model: str) -> AuditCounters:
        return self.counters.setdefault(model, AuditCounters(self.rate))

    def submit(self, placement: SplitPlacement, coordinator: SplitCoordinator, request: FinishedRequest) -> None:
        """A split request finished: audit it if it is the chain's first, or drawn at the probability its
        workers' history gives (:class:`~meshllm.split.audit.AuditPolicy`: every request while one of
        them has not passed its probation)."""
        if self.rate <= 0 or not request.tokens:
            return
        first = coordinator not in self._seen
        workers = [hop.node_id for hop in coordinator.chain[1:]]
        if not first and self._random.random() >= self.policy.probability(workers):
            return
        self._seen.add(coordinator)
        counters = self._counters(placement.engine.model_id)
        try:
            self._queue.put_nowait(_Job(placement, coordinator, request))
        except asyncio.QueueFull:
            counters.dropped += 1
            return
        counters.pending += 1
        if not self._running:
            self._running = True
            self._scope.spawn(self._run())

    async def idle(self) -> None:
        """Wait until every queued audit has run (benchmarks and tests measure one batch at a time)."""
        await self._queue.join()

    async def close(self) -> None:
        await self._scope.aclose()
        self._executor.shutdown(wait=False, cancel_futures=True)

    async def _run(self) -> None:
        while True:
            job = await self._queue.get()
            counters = self._counters(job.placement.engine.model_id)
            counters.pending -= 1
            try:
                if time.monotonic() - job.request.finished > RECORD_TTL_S / 2:
                    counters.dropped += 1  # waited so long that a failure could no longer be attributed
                else:
                    await self.audit(job.placement, job.coordinator, job.request)
            except (MeshllmError, OSError, ValueError) as exc:
                log.warning("split audit of %s could not run: %s", job.request.session, exc)
            finally:
                self._queue.task_done()

    async def audit(self, placement: SplitPlacement, coordinator: SplitCoordinator,
                    request: FinishedRequest) -> Verdict | None:
        """Recompute ``request``; on a mismatch, attribute it and evict. Returns the verdict (None: passed)."""
        model = placement.engine.model_id
        counters = self._counters(model)
        loop = asyncio.get_running_loop()

        def load(path: Path, a: int, b: int, ctx: int) -> StageModel:
            return StageModel.load(path, a, b, max_context=ctx, threads=1, gpu_layers=0, kernels=self.kernels)

        result = await loop.run_in_executor(self._executor, lambda: recompute(
            placement.ref.path, coordinator.chain, request, chunk=coordinator.deadlines.prefill_chunk,
            context=coordinator.first.max_context, bound=self.memory, load=load))
        counters.run += 1
        counters.last_ms, counters.last_ranges = round(result.seconds * 1e3, 3), len(result.ranges)
        counters.total_ms += result.seconds * 1e3
        workers = [hop.node_id for hop in coordinator.chain[1:]]
        if result.first_bad is None:
            counters.passed += 1
            self.policy.record_pass(workers)
            return None
        self.policy.forget(workers)
        counters.failed += 1
        records, evidence = await self._records(coordinator, model, request.session)
        if time.monotonic() - request.finished > RECORD_TTL_S:  # a missing record may just have expired
            records = [EXPIRED if isinstance(r, str) else r for r in records]
        verdict = attribute(honest=result.honest, received=request.tokens, records=records,
                            first_bad=result.first_bad, n_prompt=len(request.prompt))
        names = placement.names()
        nodes = [coordinator.chain[i].node_id for i in verdict.stages]
        log.warning("split %s: audit of session %s failed at token %d (got %d, the model gives %s): %s %s",
                    model, request.session, result.first_bad, request.tokens[result.first_bad], result.expected,
                    verdict.kind, ", ".join(names.get(n, short(n)) for n in nodes))
        self.publish("split_forgery", model=model, session=request.session, verdict=verdict.kind,
                     reason=verdict.reason, nodes=nodes, names=[names.get(n, short(n)) for n in nodes],
                     stages=list(verdict.stages), token_index=result.first_bad,
                     received_token=request.tokens[result.first_bad], expected_token=result.expected,
                     evidence=[evidence[i - 1] for i in verdict.stages if evidence[i - 1]])
        placement.evict(coordinator, nodes, f"{verdict.kind}: {verdict.reason}")
        return verdict

    async def _records(self, coordinator: SplitCoordinator, model: str,
                       session: str) -> tuple[list[StageRecord | str], list[dict[str, object] | None]]:
        """Every worker's checked record of ``session`` (or why not) and its evidence (digest, signature)."""
        width = coordinator.first.hparams.width
        chain = coordinator.chain
        replies = await asyncio.gather(*(self._ask(hop, model, session) for hop in chain[1:]))
        records: list[StageRecord | str] = []
        evidence: list[dict[str, object] | None] = []
        for i, (hop, reply) in enumerate(zip(chain[1:], replies, strict=True), start=1):
            if isinstance(reply, str):
                records.append(reply)
                evidence.append(None)
                continue
            try:
                verify_bytes(node_public_key(hop.node_id), DOMAIN, reply.body, reply.signature)
                record = msgspec.msgpack.decode(reply.body, type=StageRecord)
                check_record(record, model=model, session=session, coordinator=chain[0].node_id, hop=hop,
                             width=width, last=i == len(chain) - 1)
            except (MeshllmError, DecodeError, msgspec.ValidationError, msgspec.DecodeError, BadRecord) as exc:
                records.append(f"bad record: {exc}")
                evidence.append(None)
                continue
            records.append(record)
            evidence.append({"node": hop.node_id, "layers": [hop.layer_start, hop.layer_end],
                             "record_sha256": hashlib.sha256(reply.body).hexdigest(),
                             "signature": reply.signature.hex()})
        return records, evidence

    async def _ask(self, hop: Hop, model: str, session: str) -> AuditRecord | str:
        try:
            conn = await self.endpoint.connect(parse_addr(hop.addr), hop.node_id, timeout=3.0)
            stream = await conn.open_stream(KIND, max_frame=AUDIT_FRAME_MAX)
            await stream.send(AuditQuery(model=model, session=session))
            reply = await stream.recv(AuditReply, timeout=QUERY_TIMEOUT_S)
        except (NetError, OSError, DecodeError, TimeoutError) as exc:
            return f"no answer: {exc}"
        if reply is None:
            return "no answer"
        if isinstance(reply, AuditRefused):
            return f"refused: {reply.message}"
        return reply


def serve_records(endpoint: Endpoint, recorder: Recorder, key: SigningKey) -> None:
    """Answer ``stage-audit`` queries: a session's signed record, only to the coordinator that opened it."""

    async def serve(stream: Stream, peer: PeerConnection) -> None:
        query = await stream.recv(AuditQuery, timeout=5.0)
        if query is None:
            return
        record = recorder.get(query.session, peer.node_id or "")
        reply: AuditReply
        if record is None or record.model != query.model:
            reply = AuditRefused(message=f"no record of session {query.session} for node {short(peer.node_id or '')}")
        else:
            body = msgspec.msgpack.encode(record)
            reply = AuditRecord(body=body, signature=sign_bytes(key, DOMAIN, body))
        await stream.send(reply)

    endpoint.on_stream(KIND, serve, max_frame=AUDIT_FRAME_MAX)
