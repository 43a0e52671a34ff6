"""Replay: a generation whose serving node fails mid-answer continues on another node (sans-IO).

The node whose API took the request keeps, for each generation, the request and the token ids of
every delta it has passed to the client (engines and the request tunnel carry them beside the
text: :attr:`~meshllm.engine.base.TextDelta.tokens`). When the serving node dies or its stream
breaks after the first byte, the driver (:mod:`meshllm.api.mesh_backend`) sends the original
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

Bounds: at most :attr:`ReplayPolicy.max_replays` per request, each with a deadline for the
replacement's first event; a failure the request caused (a 4xx) is never replayed.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass, field

import msgspec

from meshllm.api.tunnel import TunnelEvent, failover_allowed
from meshllm.engine.base import GenerationRequest, TextDelta

DEFAULT_MAX_REPLAYS = 2


@dataclass(frozen=True)
class ReplayPolicy:
    """How far the router goes to keep a broken generation alive."""

    max_replays: int = DEFAULT_MAX_REPLAYS
    """Replays per request (0: never; a request whose serving node fails ends with the error)."""
    first_event_s: float = 30.0
    """How long a replay may take to produce its first event (finding a node, its prefill of prompt
    + continuation, its queue); past it the replay has failed."""


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
    """Replays started so far."""
    failed: set[str] = field(default_factory=set)
    """Nodes that failed this request: a replay never goes back to one of them."""
    model_sha256: str | None = None
    """The sha256 of the model file the first node served (a replacement must hold the same file)."""
    blind: bool = False
    """A delta carried text but no token ids (an engine that does not report them): not replayable."""
    finished: bool = False

    def __post_init__(self) -> None:
        self.tokens = list(self.request.continuation)

    def sent(self, event: TunnelEvent) -> None:
        """An event is about to reach the client."""
        if isinstance(event, TextDelta):
            if event.text and not event.tokens:
                self.blind = True
            self.tokens.extend(event.tokens)
        else:
            self.finished = True

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

    def begin(self, failed_node: str) -> GenerationRequest:
        """Start replay number ``replays + 1`` after ``failed_node`` failed: the request to send."""
        self.failed.add(failed_node)
        self.replays += 1
        return msgspec.structs.replace(self.request, continuation=tuple(self.tokens))

    def exclude(self, node_ids: Iterable[str]) -> list[str]:
        """Of ``node_ids``, those a replay may try (the ones that have not failed this request)."""
        return [n for n in node_ids if n not in self.failed]
