"""Replay: a generation whose serving node fails mid-answer continues on another node (sans-IO).

The node whose API took the request keeps, for each generation, the request and the token ids of
every delta it has passed to the client (engines and the request tunnel carry them beside the
text: :attr:`~meshllm.engine.base.TextDelta.tokens`). When the serving node dies or its stream
breaks after the first byte, the driver (:mod:`meshllm.runtime.mesh_backend`) sends the original
request with those ids as a forced :attr:`~meshllm.engine.base.ChatRequest.continuation` to
another node serving the same file. That engine prefills prompt + continuation, feeds the ids
silently through its text core (so stop strings, split UTF-8 characters and the token budget are
where the first engine left them, and nothing the client has seen is sent again) and goes on. Its
usage counts the replayed tokens, so the client gets one stream with one usage.

Why this is exact: greedy decoding is a function of the KV, which the replacement computes from
the same ids; sampled decoding draws step ``k`` from ``(seed, k)`` alone. A sampled request
without a seed gets one here, before it first runs, so that a replacement continues the same
random stream rather than a fresh one (the text a client sees is distributed as before: the seed
was random either way).

**Hedging**: the failure of a killed node is noticed by the transport's probes after about a
second. A stream that falls silent for much longer than its usual gap between deltas
(:meth:`Progress.stall_s`) starts its replay at once, while the first node may still answer: since
the replay is exact, whichever speaks first is the stream, and the other is dropped. The client's
gap becomes the stall delay plus the replay instead of the detection plus the replay.

Bounds: at most :attr:`ReplayPolicy.max_replays` replays per request and as many hedges, each with
a deadline for the replacement's first event; a failure the request caused (a 4xx) is never replayed.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import msgspec

from meshllm.engine.base import GenerationRequest, TextDelta
from meshllm.runtime.tunnel import TunnelEvent, failover_allowed

DEFAULT_MAX_REPLAYS = 2


@dataclass(frozen=True)
class ReplayPolicy:
    """How far the router goes to keep a broken generation alive."""

    max_replays: int = DEFAULT_MAX_REPLAYS
    """Replays per request (0: never; a request whose serving node fails ends with the error)."""
    first_event_s: float = 30.0
    """How long a replay may take to produce its first event (finding a node, its prefill of prompt
    + continuation, its queue); past it the replay has failed."""
    hedge: bool = True
    """Start the replay when the stream stalls, before the failure is certain (:meth:`Progress.stall_s`)."""
    stall_factor: float = 8.0
    """A stall is a silence this many times the stream's recent gap between deltas ..."""
    stall_min_s: float = 0.4
    """... and at least this long (scheduling noise and a neighbour's prefill chunk are shorter)."""
    stall_after: int = 8
    """Deltas a stream must have sent before its gaps are known well enough to call a silence a stall."""


def seeded(request: GenerationRequest) -> GenerationRequest:
    """``request`` with a seed when it samples without one, so a replay continues its random stream."""
    params = request.params
    if params.temperature <= 0.0 or params.seed is not None:
        return request
    seed = int.from_bytes(os.urandom(8), "little") >> 1  # 63 bits: every engine takes it as a signed int64
    return msgspec.structs.replace(request, params=msgspec.structs.replace(params, seed=seed))


@dataclass
class Progress:
    """What one generation has sent its client, and whether (and how) it can be replayed."""

    request: GenerationRequest
    """The request as first routed (with the seed :func:`seeded` gave it)."""
    policy: ReplayPolicy = field(default_factory=ReplayPolicy)
    tokens: list[int] = field(default_factory=list)
    """Token ids of the deltas sent so far (after the request's own continuation, if it had one)."""
    replays: int = 0
    """Replays that took over the generation (after a failure, or a hedge that spoke first)."""
    hedges: int = 0
    """Hedges started (replays begun on a stall, while the first node may still answer)."""
    failed: set[str] = field(default_factory=set)
    """Nodes that failed this request: a replay never goes back to one of them."""
    model_sha256: str | None = None
    """The sha256 of the model file the first node served (a replacement must hold the same file)."""
    blind: bool = False
    """A delta before the tail carried text but no token ids (an engine that does not report them): not
    replayable."""
    finished: bool = False
    tail_sent: bool = False
    """The engine's tail delta reached the client: a replacement's text is all sent already."""
    deltas: int = 0
    last_at: float | None = None
    """When the last delta was sent."""
    gap_s: float = 0.0
    """Recent gap between deltas (exponential average)."""

    def __post_init__(self) -> None:
        self.tokens = list(self.request.continuation)

    def sent(self, event: TunnelEvent, now: float) -> None:
        """An event is about to reach the client."""
        if isinstance(event, TextDelta):
            if event.text and not event.tokens and not event.final:
                self.blind = True  # (a tail may carry none: the end of a character whose tokens were sent)
            self.tokens.extend(event.tokens)
            self.tail_sent = self.tail_sent or event.final
            if self.last_at is not None:
                gap = now - self.last_at
                self.gap_s = gap if not self.gap_s else 0.8 * self.gap_s + 0.2 * gap
            self.deltas += 1
            self.last_at = now
        else:
            self.finished = True

    def passes(self, event: TunnelEvent) -> bool:
        """Whether an event goes to the client: all do, except a replacement's text after the first
        node's tail was sent (the first node broke just before its finish; the replacement, exact,
        sends that same tail again)."""
        return not (self.tail_sent and isinstance(event, TextDelta))

    def stall_s(self) -> float | None:
        """Seconds of silence after the last delta at which to hedge (start the replay while the first
        node may still answer); ``None``: never now (too early to tell, or nothing left to replay with)."""
        policy = self.policy
        if not policy.hedge or self.deltas < policy.stall_after or self.blind or self.finished \
                or max(self.replays, self.hedges) >= policy.max_replays:
            return None
        return max(policy.stall_min_s, policy.stall_factor * self.gap_s)

    def why_not(self, exc: BaseException) -> str | None:
        """Why the generation cannot be replayed after ``exc``; ``None`` when it can."""
        if self.finished:
            return "the response had already ended"
        if not failover_allowed(exc):
            return "the failure is the request's own"
        if self.blind:
            return "the serving node did not report token ids"
        if self.replays >= self.policy.max_replays:
            return f"it was already replayed {self.replays} time{'s' if self.replays != 1 else ''}" \
                if self.policy.max_replays else "replays are off"
        return None

    def begin(self, node: str, *, hedge: bool = False) -> GenerationRequest:
        """The request that continues the generation elsewhere: a replay after ``node`` failed, or a
        hedge while it stalls (it counts as a replay only if it takes over: :meth:`took_over`)."""
        if hedge:
            self.hedges += 1
        else:
            self.took_over(node)
        return msgspec.structs.replace(self.request, continuation=tuple(self.tokens))

    def took_over(self, node: str) -> None:
        """A replay replaced ``node``, which no later replay goes back to."""
        self.failed.add(node)
        self.replays += 1
