"""The node's owner-control parts wired together: command gate, relay, executor, demand, standby.

:class:`OwnerService` is built by the node after its serving side. It

- executes command envelopes addressed to this node (from the local API or a peer's ``owner``
  stream) through :class:`~meshllm.owner.policy.CommandGate` and the
  :class:`~meshllm.owner.executor.Executor`, and answers every one, refusals included, with a
  result envelope signed by this node; each outcome is an event (``owner_command``, ``owner_refused``);
- relays envelopes for other nodes (:class:`~meshllm.owner.relay.OwnerRelay`);
- counts this node's demand (the node's backend reports every request to its
  :class:`~meshllm.mesh.demand.DemandTracker`) and publishes it in the peer record every
  :data:`DEMAND_PUBLISH_S`;
- runs the standby controller when the node was started with ``--standby``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping
from typing import Any

from meshllm.errors import DecodeError, MeshllmError
from meshllm.identity.envelope import decode_envelope
from meshllm.identity.ids import node_id as node_id_of
from meshllm.identity.ids import short
from meshllm.identity.keys import NodeKey
from meshllm.identity.trust import TrustStore
from meshllm.mesh.demand import DemandTracker, ModelDemand, mesh_demand, worth_publishing
from meshllm.mesh.records import MAX_DEMAND, PeerRecord, takes_requests
from meshllm.mesh.service import MeshService
from meshllm.owner.commands import OwnerResult, command_digest, seal_result
from meshllm.owner.executor import Executor
from meshllm.owner.policy import CommandGate, refusal_code
from meshllm.owner.relay import MAX_RESULT, OwnerRelay
from meshllm.owner.standby import StandbyConfig, StandbyController, StandbyDriver, Supply
from meshllm.runtime.serving import Serving

log = logging.getLogger(__name__)

DEMAND_PUBLISH_S = 2.0


class OwnerService:
    """Owner commands, relaying, demand and standby for one node."""

    def __init__(self, key: NodeKey, mesh: MeshService, serving: Serving, *, trust: Callable[[], TrustStore],
                 certificate: Callable[[], bytes | None], rename: Callable[[str], None],
                 describe: Callable[[], dict[str, Any]], on_event: Callable[..., None],
                 standby: Mapping[str, str] | None = None, standby_config: StandbyConfig | None = None) -> None:
        """``standby``: model id -> reference of each model this node may take on demand (None: not a standby)."""
        self.key = key
        self.mesh = mesh
        self.serving = serving
        self._trust = trust
        self._certificate = certificate
        self.on_event = on_event
        self.demand = DemandTracker()
        serving.backend.demand = self.demand  # the backend counts each request as it routes it
        self.gate = CommandGate(key)
        self.relay = OwnerRelay(mesh, self.execute, on_event)
        self.standby: StandbyDriver | None = None
        if standby is not None:
            controller = StandbyController(key.node_id, sorted(standby)[:MAX_DEMAND],
                                           standby_config or StandbyConfig())
            self.standby = StandbyDriver(controller, serving, self.observe, standby, on_event)
        self.executor = Executor(serving, self.standby, rename, describe)
        self._task: asyncio.Task[None] | None = None
        self._published = 0.0

    def start(self) -> None:
        self._task = asyncio.create_task(self._publish(), name="publish-demand")
        if self.standby is not None:
            self.standby.start()

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.wait([self._task])  # (not ``await``: that would swallow our own cancellation)
        if self.standby is not None:
            await self.standby.stop()

    # -- commands ----------------------------------------------------------------------------------

    async def execute(self, envelope: bytes, timeout_s: float) -> bytes:
        """Run a command envelope addressed to this node; always a signed result envelope, never an error."""
        digest = command_digest(envelope)
        try:
            admitted = self.gate.admit(envelope, time.time(), self._certificate(), self._trust())
        except MeshllmError as exc:
            code = refusal_code(exc)
            claimed = _claimed_sender(envelope)
            log.warning("refused an owner command (claimed sender %s): %s: %s", short(claimed), code, exc)
            self.on_event("owner_refused", code=code, reason=str(exc), sender=claimed)
            return self._seal(OwnerResult(command=digest, ok=False, code=code, message=str(exc)), None)
        command = admitted.command
        self.on_event("owner_command", op=command.op, model=command.model, key=command.key, owner=admitted.owner)
        try:
            message, data = await asyncio.wait_for(self.executor.run(command),
                                                   timeout=min(timeout_s, command.timeout_s) + 5.0)
            result = OwnerResult(command=digest, ok=True, code="ok", message=message, data=data)
        except TimeoutError:
            result = OwnerResult(command=digest, ok=False, code="timeout",
                                 message=f"{command.op} did not finish within {command.timeout_s:g} s")
        except MeshllmError as exc:
            text = f"{exc} ({exc.hint})" if exc.hint else str(exc)
            result = OwnerResult(command=digest, ok=False, code="failed", message=text)
        self.on_event("owner_done", op=command.op, model=command.model, ok=result.ok, code=result.code,
                      message=result.message)
        return self._seal(result, admitted.owner)

    def _seal(self, result: OwnerResult, owner: str | None) -> bytes:
        sealed = seal_result(self.key, result, time.time(), owner)
        if len(sealed) > MAX_RESULT - 1024:  # leave room for the relay frame around it
            result = OwnerResult(command=result.command, ok=result.ok, code=result.code,
                                 message=result.message + " (details left out: too large)")
            sealed = seal_result(self.key, result, time.time(), owner)
        return sealed

    # -- demand and standby ------------------------------------------------------------------------

    async def _publish(self) -> None:
        """Copy our demand (and standby list) into our record when it changes."""
        while True:
            try:
                self.publish(time.time())
            except Exception:
                log.exception("publishing demand failed")
            await asyncio.sleep(DEMAND_PUBLISH_S)

    def publish(self, now: float) -> None:
        """Re-sign our record when the demand map changed enough (``worth_publishing``) or the standby list did."""
        gossip = self.mesh.gossip
        assert gossip is not None
        demand = self.demand.entries(now)
        standby = self.standby_models()
        own = gossip.own
        if standby != own.standby or worth_publishing(own.demand, demand, now - self._published):
            self._published = now
            self.mesh.update_own(demand=demand, standby=standby)

    def standby_models(self) -> list[str]:
        """What our record offers as standby: the library, while the controller is enabled."""
        if self.standby is None or not self.standby.controller.enabled:
            return []
        return list(self.standby.controller.candidates)

    def records(self) -> list[PeerRecord]:
        """Our record and the alive members'."""
        gossip = self.mesh.gossip
        assert gossip is not None
        alive = [e.record for n, e in gossip.state.peers.items() if e.status == "alive" and n != self.key.node_id]
        return [gossip.own, *alive]

    def mesh_demand(self, now: float) -> dict[str, ModelDemand]:
        """The merged demand map, with our own counts as of now (our record lags by a publish period)."""
        others = [(r.node_id, r.demand) for r in self.records()[1:]]
        return mesh_demand([(self.key.node_id, self.demand.entries(now)), *others], now)

    def observe(self, now: float) -> tuple[dict[str, ModelDemand], dict[str, Supply], dict[str, list[str]]]:
        """The standby controller's inputs: demand, who serves each model and how loaded, the standbys."""
        supply: dict[str, Supply] = {}
        for record in self.records():
            load = record.load
            for model in record.models.served:
                if takes_requests(model):
                    have = supply.get(model.name, Supply())
                    free = have.free_slots
                    if load.slots:  # a node too old to report slots adds nothing to what is known free
                        free = (free or 0) + load.free_slots
                    supply[model.name] = Supply((*have.servers, record.node_id), have.queue + load.queue, free)
        standbys = {r.node_id: list(r.standby) for r in self.records()[1:] if r.standby}
        standbys[self.key.node_id] = self.standby_models()
        return self.mesh_demand(now), supply, standbys

    def status(self, now: float) -> dict[str, Any]:
        """``/api/status`` ``demand`` and ``standby``."""
        served: dict[str, list[str]] = {}
        standby: dict[str, list[str]] = {}
        for record in self.records():
            name = record.name or short(record.node_id)
            for model in record.models.served:
                if takes_requests(model):
                    served.setdefault(model.name, []).append(name)
            for model_id in record.standby:
                standby.setdefault(model_id, []).append(name)
        demand = [{"model": d.model, "requests": d.requests, "unmet": d.unmet,
                   "last_active_age_s": round(max(0.0, now - d.last_active), 1),
                   "origins": len(d.origins), "served_by": served.get(d.model, []),
                   "standby": standby.get(d.model, [])}
                  for d in sorted(self.mesh_demand(now).values(), key=lambda d: (-d.requests, d.model))]
        return {"demand": demand,
                "standby": self.standby.controller.status(now) if self.standby is not None else None}


def _claimed_sender(envelope: bytes) -> str:
    """Who an envelope says it is from (unverified: for logs only)."""
    try:
        return node_id_of(decode_envelope(envelope).sender)
    except DecodeError:
        return "?"
