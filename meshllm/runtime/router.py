"""Where a request runs: a sans-IO routing core (no sockets, no clock; ``now`` is passed in).

Order of candidates for a model:

1. **This node**, if it serves the model and has a free slot: no network hop beats a local engine.
2. **The affinity peer**: requests of one session (same ``user``) or one prompt prefix (same
   system prompt and tools) go to the same peer, whose llama.cpp KV cache already holds that
   prefix. Rendezvous hashing picks it, so every node picks the same peer without coordination
   and a peer leaving moves only its own sessions. It is skipped when it has no free slot (or,
   for a peer that does not report slots, when its queue is deep).
3. **Healthy peers with a free slot** (or idle ones that do not report slots), nearest first:
   a request there starts at once, which beats waiting here.
4. **This node** when all its slots are busy.
5. **Other healthy peers**, by a cost in milliseconds: RTT plus a fixed price per queued or
   running request.
6. **Peers cooling down** after failures, soonest-available first: a last resort, not excluded,
   since a cooling peer beats no answer.

A failure puts a target in cooldown, doubling with each consecutive failure up to a cap; a
success clears it. :class:`Attempt` walks the order for one request and allows failover only
until the first byte reached the client; after that a retry would duplicate text.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from meshllm.engine.base import ChatRequest, GenerationRequest


@dataclass(frozen=True)
class PeerView:
    """What gossip says about one peer, as far as routing cares."""

    node_id: str
    models: frozenset[str]
    """Model ids the peer serves."""
    load: int = 0
    """Requests running plus queued on the peer."""
    free_slots: int | None = None
    """Slots free on the peer (``None``: it does not report slots)."""
    rtt_ms: float | None = None
    """Measured round trip to the peer; ``None`` before the first probe."""
    alive: bool = True
    """False once the failure detector marks the peer suspect or down."""


@dataclass(frozen=True)
class Target:
    """One place to try a request."""

    node_id: str
    local: bool = False


MAX_COUNTED_FAILURES = 64
"""Consecutive failures counted per target; 2**63 times any base already exceeds every sensible cap."""


@dataclass
class _Health:
    failures: int = 0
    until: float = 0.0


@dataclass
class RouterConfig:
    """Tuning knobs; defaults suit a LAN or a few WAN hops."""

    cooldown_base_s: float = 1.0
    """Cooldown after the first failure; doubles per consecutive failure."""
    cooldown_max_s: float = 60.0
    """Cooldown cap."""
    load_cost_ms: float = 250.0
    """Price of one running or queued request on a peer, in RTT milliseconds."""
    unknown_rtt_ms: float = 100.0
    """RTT assumed for a peer not yet probed."""
    affinity_max_load: int = 4
    """An affinity peer with more running+queued requests than this loses its priority."""


def affinity_key(request: GenerationRequest) -> str | None:
    """The session or prefix a request belongs to, or ``None`` when it has neither.

    ``user`` names a session. Without it, a chat's system prompt and tools name a prefix
    that many requests share (an agent, an app). Plain completions without a user have none.
    """
    if request.user:
        return "user:" + request.user
    if isinstance(request, ChatRequest):
        system = [m.content for m in request.messages if m.role in ("system", "developer")]
        if system or request.tools:
            blob = json.dumps([system, list(request.tools)], sort_keys=True, default=str)
            return "prefix:" + hashlib.sha256(blob.encode()).hexdigest()
    return None


def rendezvous_score(key: str, node_id: str) -> int:
    """Highest-random-weight hash: the node with the largest score for ``key`` owns it."""
    return int.from_bytes(hashlib.blake2b(f"{key}\0{node_id}".encode(), digest_size=8).digest(), "big")


class Router:
    """Ranks targets for a model and remembers each target's recent failures."""

    def __init__(self, local_node_id: str, config: RouterConfig | None = None) -> None:
        self.local_node_id = local_node_id
        self.config = config or RouterConfig()
        self._health: dict[str, _Health] = {}

    # ---- health ----------------------------------------------------------------------------

    def record_failure(self, node_id: str, now: float) -> float:
        """Note a failed attempt; return when the target may be preferred again.

        The failure count is capped before it is used as an exponent: thousands of failures in a row
        (a flood of requests to a broken peer) must neither overflow a float nor grow an integer.
        """
        health = self._health.setdefault(node_id, _Health())
        health.failures = min(health.failures + 1, MAX_COUNTED_FAILURES)
        cfg = self.config
        delay = min(cfg.cooldown_base_s * 2.0 ** (health.failures - 1), cfg.cooldown_max_s)
        health.until = now + delay
        return health.until

    def record_success(self, node_id: str) -> None:
        """A served request clears the target's failure history."""
        self._health.pop(node_id, None)

    def cooling_until(self, node_id: str, now: float) -> float | None:
        """End of the target's cooldown, or ``None`` if it is not cooling at ``now``."""
        health = self._health.get(node_id)
        return health.until if health is not None and health.until > now else None

    def forget(self, node_ids: Iterable[str]) -> None:
        """Drop health state of peers that left the mesh (keeps the table bounded)."""
        for node_id in node_ids:
            self._health.pop(node_id, None)

    # ---- ordering --------------------------------------------------------------------------

    def order(self, model: str, *, local_models: Iterable[str], peers: Iterable[PeerView], now: float,
              key: str | None = None, local_free: int | None = None) -> list[Target]:
        """Every target that could serve ``model``, best first (empty: nobody serves it).

        ``local_free``: free slots of this node's engine for ``model`` (``None``: not known, taken as free).
        """
        cfg = self.config
        targets: list[Target] = []
        local = Target(self.local_node_id, local=True) if model in set(local_models) else None
        local_busy = local is not None and local_free is not None and local_free <= 0
        if local is not None and not local_busy:
            targets.append(local)
        candidates = [p for p in peers if p.alive and model in p.models and p.node_id != self.local_node_id]
        healthy = [p for p in candidates if self.cooling_until(p.node_id, now) is None]
        cooling = sorted((p for p in candidates if self.cooling_until(p.node_id, now) is not None),
                         key=lambda p: (self._health[p.node_id].until, p.node_id))

        def starts_now(p: PeerView) -> bool:
            return p.free_slots > 0 if p.free_slots is not None else p.load == 0

        if key is not None and healthy:
            owner = max(healthy, key=lambda p: (rendezvous_score(key, p.node_id), p.node_id))
            if starts_now(owner) or (owner.free_slots is None and owner.load <= cfg.affinity_max_load):
                targets.append(Target(owner.node_id))
                healthy.remove(owner)

        def cost(p: PeerView) -> tuple[float, int, str]:
            rtt = cfg.unknown_rtt_ms if p.rtt_ms is None else p.rtt_ms
            return rtt + cfg.load_cost_ms * (0 if starts_now(p) else p.load), -(p.free_slots or 0), p.node_id

        targets += [Target(p.node_id) for p in sorted((p for p in healthy if starts_now(p)), key=cost)]
        if local_busy:
            assert local is not None
            targets.append(local)
        targets += [Target(p.node_id) for p in sorted((p for p in healthy if not starts_now(p)), key=cost)]
        targets += [Target(p.node_id) for p in cooling]
        return targets


@dataclass
class Attempt:
    """One request's walk down its target list (sans-IO: the driver reports what happened).

    The driver calls :meth:`next_target`, tries it, calls :meth:`first_byte` when the first
    event is forwarded to the client, and :meth:`failed` on an error. ``failed`` returns
    whether another target may be tried.
    """

    targets: Sequence[Target]
    router: Router
    tried: list[Target] = field(default_factory=list)
    committed: bool = False

    def next_target(self) -> Target | None:
        """The next untried target, or ``None`` when all have been tried or we are committed."""
        if self.committed or len(self.tried) >= len(self.targets):
            return None
        target = self.targets[len(self.tried)]
        self.tried.append(target)
        return target

    def first_byte(self) -> None:
        """The client has seen output from the current target: no more failover."""
        self.committed = True

    def failed(self, now: float) -> bool:
        """The current target failed; cool it down. True if failing over is still allowed."""
        if self.tried:
            self.router.record_failure(self.tried[-1].node_id, now)
        return not self.committed and len(self.tried) < len(self.targets)

    def succeeded(self) -> None:
        """The current target served the request to its end."""
        if self.tried:
            self.router.record_success(self.tried[-1].node_id)
