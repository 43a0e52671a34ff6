"""Standby nodes: start serving a model the mesh wants and cannot keep up with; stop once it is idle.

:class:`StandbyController` is sans-IO: each :meth:`~StandbyController.step` gets the mesh's demand
map (``mesh/demand.py``), what every node serves and how loaded it is, which nodes are standbys for
which models, and ``now``; it returns what to do. The driver (:class:`StandbyDriver`) feeds it from
gossip every half second and loads or unloads through :class:`~meshllm.runtime.serving.Serving`.

A model **needs help** when it was asked for within ``active_s`` and either nobody serves it
(``unserved``), or requests for it were refused everywhere (``refused``: 503/429 at their origin),
or its servers have ``queue_depth`` or more requests waiting and no free slot (``queue``). A standby
promotes such a model once the need has lasted ``hold_s``, plus ``stagger_s`` for every other standby
ranked ahead of it for that model (rendezvous hashing: every node ranks the same way, without
talking). Whenever the set of servers changes, the clock restarts, so once the first standby serves
the model, the next one acts only if the need persists for its whole wait with that one serving
(which is longer than a load figure takes to reach it by gossip): two standbys do not both jump on
one surge. A promoted model is unloaded after ``idle_s`` without a request on it, and that
model is then not taken again for ``cooldown_s``. Only models the controller loaded itself are
ever unloaded by it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from meshllm.errors import MeshllmError
from meshllm.mesh.demand import ModelDemand
from meshllm.runtime.router import rendezvous_score

log = logging.getLogger(__name__)

Reason = Literal["unserved", "refused", "queue"]
STEP_S = 0.5


@dataclass(frozen=True)
class StandbyConfig:
    """Thresholds and timers; the defaults suit a LAN mesh of a few nodes."""

    hold_s: float = 2.0
    """A need must last this long before the first-ranked standby acts."""
    stagger_s: float = 4.0
    """Extra wait for each standby ranked ahead for the same model."""
    idle_s: float = 300.0
    """A promoted model with no request for this long is unloaded."""
    cooldown_s: float = 60.0
    """After unloading a model, do not take it again for this long."""
    queue_depth: int = 1
    """Requests waiting at the model's servers (summed) that count as more than they can take."""
    active_s: float = 30.0
    """Demand counts while its latest request is at most this old."""


@dataclass(frozen=True)
class Supply:
    """Who serves one model now, and how loaded they are (from their records)."""

    servers: tuple[str, ...] = ()
    queue: int = 0
    """Requests waiting at those servers (their whole node's queue: records give load per node)."""
    free_slots: int | None = None
    """Free slots summed over the servers that report slots (per node, like ``queue``); ``None`` when none does."""


@dataclass(frozen=True)
class Promote:
    model: str
    reason: Reason


@dataclass(frozen=True)
class Demote:
    model: str
    idle_s: float


Action = Promote | Demote


@dataclass
class _Watch:
    """One wanted model, watched while its set of servers stays the same."""

    servers: tuple[str, ...]
    unmet_floor: int
    """The fewest refusals the demand map showed since: only refusals beyond it are new."""
    reason: Reason | None = None
    since: float | None = None
    """When the current need began (``None``: no need now)."""


@dataclass
class StandbyController:
    """Decides, for one standby node, which wanted models to start or stop serving."""

    node_id: str
    candidates: Sequence[str]
    """Models this node can load (its standby library), by model id."""
    config: StandbyConfig = field(default_factory=StandbyConfig)
    enabled: bool = True
    promoted: dict[str, float] = field(default_factory=dict)
    """Models this controller loaded, with the time it did."""
    _watch: dict[str, _Watch] = field(default_factory=dict)
    _cooldown: dict[str, float] = field(default_factory=dict)
    decisions: deque[dict[str, Any]] = field(default_factory=lambda: deque(maxlen=20))
    """The latest decisions, newest last (for ``/api/status`` and the dashboard)."""

    def wanted(self, model: str, demand: Mapping[str, ModelDemand], now: float) -> ModelDemand | None:
        """The demand for ``model`` if it was asked for recently enough to count."""
        wanted = demand.get(model)
        if wanted is None or not wanted.requests or now - wanted.last_active > self.config.active_s:
            return None
        return wanted

    def need(self, wanted: ModelDemand, supply: Supply, unmet_floor: int) -> Reason | None:
        """Why a wanted model needs another server now, or ``None``.

        Refusals count only beyond ``unmet_floor``: the demand map counts over a minute, and those
        from before the last change of servers say nothing about whether the new set keeps up.
        """
        if not supply.servers:
            return "unserved"
        if wanted.unmet > unmet_floor:
            return "refused"
        if supply.queue >= self.config.queue_depth and not supply.free_slots:
            return "queue"
        return None

    def rank(self, model: str, standbys: Mapping[str, Sequence[str]]) -> int:
        """How many standbys for ``model`` go before this node (those serving it already included, so a
        node's rank does not move when another one takes the model)."""
        rivals = [n for n, models in standbys.items() if model in models]
        if self.node_id not in rivals:
            rivals.append(self.node_id)
        order = sorted(rivals, key=lambda n: (-rendezvous_score(model, n), n))
        return order.index(self.node_id)

    def step(self, now: float, demand: Mapping[str, ModelDemand], supply: Mapping[str, Supply],
             standbys: Mapping[str, Sequence[str]], last_used: Mapping[str, float], loading: bool) -> list[Action]:
        """What to do now. ``last_used``: wall-clock time each promoted model was last used here;
        ``loading``: a load or unload of ours is in progress (one at a time)."""
        actions: list[Action] = []
        for model, loaded_at in list(self.promoted.items()):
            idle = now - max(loaded_at, last_used.get(model, loaded_at))
            if idle >= self.config.idle_s and not loading:
                actions.append(Demote(model, round(idle, 1)))
        if not self.enabled:
            self._watch.clear()
            return actions
        for model in self.candidates:
            if model in self.promoted:
                continue
            have = supply.get(model, Supply())
            if self.node_id in have.servers:
                self._watch.pop(model, None)  # served here already (loaded by hand)
                continue
            wanted = self.wanted(model, demand, now)
            if wanted is None:
                self._watch.pop(model, None)
                continue
            watch = self._watch.get(model)
            if watch is None or watch.servers != have.servers:  # new servers: time the need afresh
                watch = self._watch[model] = _Watch(have.servers, wanted.unmet)
            watch.unmet_floor = min(watch.unmet_floor, wanted.unmet)
            watch.reason = self.need(wanted, have, watch.unmet_floor)
            if watch.reason is None:
                watch.since = None
                continue
            if watch.since is None:
                watch.since = now
            if now < self._cooldown.get(model, 0.0) or loading or actions:
                continue
            wait = self.config.hold_s + self.config.stagger_s * self.rank(model, standbys)
            if now - watch.since >= wait:
                actions.append(Promote(model, watch.reason))
        return actions

    def promoted_now(self, model: str, now: float, reason: str) -> None:
        """The driver loaded ``model`` for a :class:`Promote`."""
        self.promoted[model] = now
        self._watch.pop(model, None)
        self.decisions.append({"at": round(now, 3), "model": model, "action": "promote", "reason": reason})

    def demoted_now(self, model: str, now: float, reason: str) -> None:
        """The driver unloaded ``model`` (idle, or the owner unloaded it): cool it down."""
        if self.promoted.pop(model, None) is not None:
            self._cooldown[model] = now + self.config.cooldown_s
        self.decisions.append({"at": round(now, 3), "model": model, "action": "demote", "reason": reason})

    def failed(self, model: str, now: float, reason: str) -> None:
        """A promotion failed (no memory, a bad file): do not retry it before the cool-down."""
        self._cooldown[model] = now + self.config.cooldown_s
        self._watch.pop(model, None)
        self.decisions.append({"at": round(now, 3), "model": model, "action": "failed", "reason": reason})

    def status(self, now: float) -> dict[str, Any]:
        """``/api/status`` ``standby``."""
        waiting = [{"model": m, "reason": w.reason, "for_s": round(now - w.since, 1)}
                   for m, w in self._watch.items() if w.since is not None]
        return {
            "enabled": self.enabled, "candidates": list(self.candidates),
            "serving": sorted(self.promoted), "waiting": waiting,
            "cooling": sorted(m for m, until in self._cooldown.items() if until > now),
            "idle_s": self.config.idle_s, "decisions": list(self.decisions),
        }


class StandbyDriver:
    """Runs a :class:`StandbyController` against the live mesh and this node's engines.

    ``observe()`` returns ``(demand, supply, standbys)`` from gossip; ``serving`` is the node's
    :class:`~meshllm.runtime.serving.Serving`.
    """

    def __init__(self, controller: StandbyController, serving: Any,
                 observe: Callable[[float], tuple[Mapping[str, ModelDemand], Mapping[str, Supply],
                                                  Mapping[str, Sequence[str]]]],
                 specs: Mapping[str, str], on_event: Callable[..., None]) -> None:
        self.controller = controller
        self.serving = serving
        self.observe = observe
        self.specs = dict(specs)
        """Model id -> the reference to load it from."""
        self.on_event = on_event
        self.last_used: dict[str, float] = {}
        """Wall-clock time each promoted model was last seen busy."""
        self._seen: dict[str, tuple[int, int, float]] = {}
        self._task: asyncio.Task[None] | None = None
        self._busy: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="standby")

    async def stop(self) -> None:
        for task in (self._task, self._busy):
            if task is not None:
                task.cancel()
                await asyncio.wait([task])  # (not ``await``: that would swallow our own cancellation)

    def set_idle(self, idle_s: float) -> None:
        self.controller.config = replace(self.controller.config, idle_s=idle_s)

    async def _run(self) -> None:
        while True:
            try:
                self.tick(time.time())
            except Exception:
                log.exception("standby step failed")
            await asyncio.sleep(STEP_S)

    def tick(self, now: float) -> None:
        """One controller step; starts at most one load or unload."""
        ctl = self.controller
        loading = self._busy is not None and not self._busy.done()
        if not loading:
            for model in [m for m in ctl.promoted if m not in self.serving.loaded]:
                ctl.demoted_now(model, now, "unloaded by the owner")  # an owner unload or drain
        self._watch_use(now)
        demand, supply, standbys = self.observe(now)
        for action in ctl.step(now, demand, supply, standbys, self.last_used, loading):
            if isinstance(action, Promote):
                self._busy = asyncio.create_task(self._promote(action), name=f"standby-load-{action.model}")
            else:
                self._busy = asyncio.create_task(self._demote(action), name=f"standby-unload-{action.model}")
            break

    def _watch_use(self, now: float) -> None:
        """A promoted model counts as used at ``now`` while its engine has requests, or when its load
        report changed since the last tick (a request came and went in between)."""
        for model in self.controller.promoted:
            engine = self.serving.engines.get(model)
            if engine is None:
                continue
            report = engine.load_report()
            seen = (report.running, report.queued, report.tokens_per_s)
            if report.running or report.queued or seen != self._seen.get(model, seen):
                self.last_used[model] = now
            self._seen[model] = seen

    async def _promote(self, action: Promote) -> None:
        ctl = self.controller
        self.on_event("standby_promote", model=action.model, reason=action.reason)
        try:
            await self.serving.load_model(self.specs[action.model])
        except MeshllmError as exc:
            ctl.failed(action.model, time.time(), str(exc))
            self.on_event("standby_failed", model=action.model, error=str(exc))
            return
        now = time.time()
        ctl.promoted_now(action.model, now, action.reason)
        self.last_used[action.model] = now

    async def _demote(self, action: Demote) -> None:
        self.on_event("standby_demote", model=action.model, idle_s=action.idle_s)
        with contextlib.suppress(MeshllmError):
            await self.serving.unload_model(action.model, timeout_s=30.0)
        self.controller.demoted_now(action.model, time.time(), f"idle {action.idle_s:g} s")
        self.last_used.pop(action.model, None)
        self._seen.pop(action.model, None)
