"""The composition root: builds one node's parts, starts them in order, stops them in reverse.

A node is: its key and mesh membership, the mesh service (QUIC endpoint, gossip, failure
detection), the engines of the models it serves, and the HTTP API (OpenAI routes, status, events)
served by uvicorn inside the node's own event loop. Everything a user sees about the node's life
goes through :class:`~meshllm.events.EventHub`.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
import resource
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import msgspec
import uvicorn

from meshllm import __version__
from meshllm.api.app import create_app
from meshllm.api.auth import ApiAccess, check_api_key
from meshllm.api.blackboard import blackboard_router
from meshllm.api.connections import ACCEPT_BACKLOG, guarded_protocol
from meshllm.api.console import console_router
from meshllm.api.discovery_routes import discovery_router
from meshllm.api.edge import EdgePolicy, is_loopback_host
from meshllm.api.health import Readiness
from meshllm.api.limits import EdgeLimits
from meshllm.api.mcp import McpEndpoint, build_server
from meshllm.api.metrics import metrics_router
from meshllm.api.model_routes import models_router
from meshllm.api.owner_routes import owner_router
from meshllm.api.split_routes import plan_router
from meshllm.api.status import mesh_links, status_router
from meshllm.config import (
    MODEL_HASHES_FILE,
    NODE_CERT_FILE,
    OWNER_KEYSTORE_FILE,
    REVOCATIONS_FILE,
    ensure_home,
    load_config,
    load_or_create_admin_token,
    resolve_home,
)
from meshllm.discovery.listing import LISTING_TTL_S
from meshllm.discovery.publisher import NodeDiscovery, facts_from_records
from meshllm.engine.base import DEFAULT_MAX_TOKENS
from meshllm.engine.capacity import compute_devices, measure_capacity
from meshllm.engine.kernels import Kernels
from meshllm.engine.speculate import SpeculateMode
from meshllm.errors import ConfigError, DecodeError, KeystoreError, MeshllmError, VerificationError
from meshllm.events import EventHub
from meshllm.identity.certs import decode_certificate, open_certificate
from meshllm.identity.ids import b32, node_public_key, unb32
from meshllm.identity.keys import NodeKey
from meshllm.identity.keystore import obtain_passphrase, read_keystore, unlock_keystore
from meshllm.identity.trust import TrustStore
from meshllm.mesh.admission import INVITE_ID_BYTES
from meshllm.mesh.blackboard_service import BlackboardService
from meshllm.mesh.membership import Membership, join_mesh, own_mesh
from meshllm.mesh.passive import NoBoard, PassiveMesh, PullOnUnmet
from meshllm.mesh.records import MAX_AVAILABLE, DiskModel, PeerRecord
from meshllm.mesh.routes import PULL_INTERVAL_S
from meshllm.mesh.routes_service import RouteService
from meshllm.mesh.service import MeshService
from meshllm.models.library import Library
from meshllm.models.store import ModelStore, Offer
from meshllm.net.endpoint import EndpointOptions
from meshllm.owner.service import OwnerService
from meshllm.owner.standby import StandbyConfig
from meshllm.runtime.replay import DEFAULT_MAX_REPLAYS, ReplayPolicy
from meshllm.runtime.serving import Serving
from meshllm.split.placement import SplitOptions
from meshllm.split.service import SplitService, offered_capacity
from meshllm.wire.addr import format_addr

log = logging.getLogger(__name__)

Role = Literal["host", "worker", "client"]
SERVE_INVITE_TTL_S = 24 * 3600.0
"""Invite ids are 10 random bytes, 16 base32 characters (``MeshKey.invite``)."""
STARTUP_WAIT_S = 10.0
"""While a node starts, how long a peer's stream of a kind its services have not registered yet waits
(``EndpointOptions.startup_wait_s``): peers hear of a member as soon as it joins, before its stage
host, blackboard or owner service serve."""


@dataclass
class NodeOptions:
    """Everything ``meshllm serve`` can set."""

    home: Path | None = None
    name: str = ""
    api_host: str = "127.0.0.1"
    api_port: int = 9337
    mesh_host: str = "0.0.0.0"
    mesh_port: int = 9338
    announce: list[str] = field(default_factory=list)
    join: str | None = None
    """Invite token to join with; ``None`` owns (creates or reuses) the mesh in ``home``."""
    bootstrap: list[str] = field(default_factory=list)
    """Members to dial instead of the invite's addresses."""
    ephemeral: bool = False
    role: Role = "host"
    passive: bool = False
    """A ``--client`` that joins (without ``--member``): stay out of gossip and route from tables pulled from
    members (``mesh/routes.py``); members hold nothing about the node beyond its connections."""
    routes_interval_s: float = PULL_INTERVAL_S
    """``--routes-interval``: how often a passive client pulls the route table (and at once on demand)."""
    models: list[str] = field(default_factory=lambda: ["default"])
    engine: str = "llama"
    threads: int | None = None
    """CPU threads per model and per stage (None: the machine's cores, up to 8)."""
    gpu_layers: int | None = None
    """Layers put on the accelerator, for whole models and stages (None: all that fit; -1: all)."""
    parallel: int | None = None
    """llama.cpp slots per model: requests generated at once in one batch (None: sized from memory)."""
    max_tokens_default: int = DEFAULT_MAX_TOKENS
    """Tokens generated for a request that sets no ``max_tokens``."""
    replays: int = DEFAULT_MAX_REPLAYS
    """Replays per routed generation whose serving node fails mid-answer (``meshllm.runtime.replay``)."""
    kernels: Kernels = "exact"
    """ggml kernels of every engine and stage: row-exact (answers independent of batching) or fast."""
    relay: Literal["on", "off", "auto"] = "auto"
    """Relay for members behind NATs: always, never, or when peers find us reachable (auto)."""
    split: SplitOptions = field(default_factory=SplitOptions)
    """``--split``/``--stages``/``--max-memory``: whether and how to split models over workers."""
    speculate: SpeculateMode = "auto"
    """``--speculate``: speculative decoding on split chains and the llama engine (docs/splits.md)."""
    dht_bootstrap: list[str] = field(default_factory=list)
    """DHT peers (multiaddrs) to join at start; the DHT also starts on the first publish."""
    dht_port: int | None = None
    """TCP port of the DHT node; set, it starts the DHT at start (a bootstrap peer for others)."""
    listing_ttl_s: float = LISTING_TTL_S
    """Lifetime of published listings (republished every half of it); short only in tests."""
    api_keys: list[str] = field(default_factory=list)
    """``--api-key``: secrets clients on other machines send; required when the API binds beyond loopback."""
    cors_origins: list[str] = field(default_factory=list)
    """``--cors-origin``: web origins whose pages may use the API, besides loopback pages (``*``: any)."""
    metrics_public: bool = False
    """``--metrics-public``: ``GET /metrics`` answers without a secret (for a scraper on a trusted network)."""
    allowed_hosts: list[str] = field(default_factory=list)
    """``--allowed-host``: host names requests may carry besides localhost and IP literals (``*``: any)."""
    edge: EdgeLimits = field(default_factory=EdgeLimits)
    """HTTP connection cap and read deadlines."""
    standby: bool = False
    """``--standby``: load none of ``models`` at start; serve each when the mesh wants it and cannot keep up."""
    standby_idle_s: float = StandbyConfig.idle_s
    """``--standby-idle``: a model a standby took is unloaded after this long without a request."""


class Node:
    """One running meshllm node."""

    def __init__(self, options: NodeOptions, events: EventHub | None = None) -> None:
        self.options = options
        api_keys = _api_keys(options)
        self.policy = EdgePolicy.build(options.api_host, options.allowed_hosts, options.cors_origins)
        self.events = events or EventHub()
        self.readiness = Readiness()
        self.events.add_sink(self.readiness.on_event)
        self.home = ensure_home(resolve_home(options.home))
        self.admin_token = load_or_create_admin_token(self.home)
        """Management calls need it (or an API key); the CLI reads it from the home."""
        self.access = ApiAccess(self.admin_token, api_keys)
        self.key = NodeKey.ephemeral() if options.ephemeral else NodeKey.load_or_create(self.home)
        self.name = options.name or self.key.node_id[:8]
        self.started_at = time.time()
        self.membership: Membership | None = None
        self.mesh: MeshService | PassiveMesh | None = None
        self.routes: RouteService | None = None
        """Route tables served to passive clients (members only)."""
        self.blackboard: BlackboardService | None = None
        self.serving: Serving | None = None
        self.splits: SplitService | None = None
        self.store: ModelStore | None = None
        self._scan_task: asyncio.Task[None] | None = None
        self.owner: OwnerService | None = None
        self.discovery: NodeDiscovery | None = None
        self.api_url = ""
        self.invite: str | None = None
        """The invite printed at start (owner only)."""
        self.mcp: McpEndpoint | None = None
        self._server: uvicorn.Server | None = None
        self._server_task: asyncio.Task[None] | None = None

    # -- lifecycle ------------------------------------------------------------------------------

    async def start(self) -> None:
        """Join or own the mesh, load models, open the API; then publish ``ready``."""
        opts = self.options
        now = time.time()
        if opts.passive and (opts.role != "client" or not opts.join):
            raise ConfigError("a passive client joins a mesh and serves nothing",
                              hint="the mesh owner's node, serving nodes and workers are gossip members")
        if opts.join:
            home = None if opts.ephemeral else self.home  # where a granted credential is kept
            self.membership = join_mesh(self.key.signing_key, opts.join, now, home=home)
        else:
            self.membership = own_mesh(self.key.signing_key, self.home, now)
        if opts.bootstrap:
            self.membership.bootstrap = list(opts.bootstrap)
        trust = TrustStore.load(self.home)
        record = PeerRecord(
            node_id=self.key.node_id, mesh_id=self.membership.mesh_id, seq=0,
            membership_proof=self.membership.proof, owner_cert=self._owner_cert(), name=self.name,
            role=opts.role, version=__version__,
            capacity=offered_capacity(await asyncio.to_thread(measure_capacity), opts.role, opts.split.max_memory),
        )
        if opts.passive:
            self.mesh = PassiveMesh(self.key, self.membership, record, check_trust=trust.evaluate,
                                    check_node_id=trust.check_node_id, on_event=self.events.publish,
                                    host=opts.mesh_host, port=opts.mesh_port, interval=opts.routes_interval_s)
            await self.mesh.start()
        else:
            self.mesh = MeshService(
                self.key, self.membership, record,
                check_trust=trust.evaluate,
                check_node_id=trust.check_node_id,
                on_event=self.events.publish, host=opts.mesh_host, port=opts.mesh_port, announce=opts.announce,
                relay=opts.relay, revocations_file=self.home / REVOCATIONS_FILE,
                endpoint_options=EndpointOptions(startup_wait_s=STARTUP_WAIT_S),
            )
            await self.mesh.start()
            await self.mesh.first_view()
            self.routes = RouteService(self.mesh)
            self.blackboard = BlackboardService(self.mesh, self.events.publish)
            self.blackboard.start()
        assert self.mesh.endpoint is not None
        self.store = ModelStore(Library.for_home(self.home), self.mesh.endpoint, self.key.signing_key,
                                self._model_offers, self.events.publish, on_change=self._advertise_models,
                                bulk_ports=self._bulk_port, upload_bytes_s=self._upload_cap())
        if not opts.passive:  # a passive client offers no model files: nobody would know to ask it
            await self._start_bulk()
        self._advertise_models()
        self._scan_task = asyncio.create_task(self._scan_library(), name="scan-model-library")
        self.serving = Serving(self.key.node_id, self.mesh, self.events, store=self.store,
                               hash_cache=self.home / MODEL_HASHES_FILE, replay=ReplayPolicy(max_replays=opts.replays),
                               model_defaults=load_config(self.home).models)
        split = dataclasses.replace(opts.split, threads=opts.threads, gpu_layers=opts.gpu_layers, kernels=opts.kernels,
                                    speculate=opts.speculate)
        self.splits = SplitService(self.mesh, self.serving, self.events, opts.role, split, self.store,
                                   self.key.signing_key)
        self.owner = OwnerService(
            self.key, self.mesh, self.serving, trust=lambda: TrustStore.load(self.home), certificate=self._owner_cert,
            rename=self._rename, describe=self._describe, on_event=self.events.publish,
            standby=await self._standby_library(), standby_config=StandbyConfig(idle_s=opts.standby_idle_s),
        )
        if isinstance(self.mesh, PassiveMesh):
            self.serving.backend.demand = PullOnUnmet(self.serving.backend.demand, self.mesh)
        self.discovery = self._make_discovery()
        await self._start_api()
        self.events.publish("mesh_ready", mesh_id=self.membership.mesh_id, mesh_addr=self.mesh_addr)
        whole = await self.splits.prepare(opts.models if opts.role == "host" and not opts.standby else [])
        await self.serving.load_models(whole, engine=opts.engine, threads=opts.threads, gpu_layers=opts.gpu_layers,
                                       parallel=opts.parallel, max_tokens_default=opts.max_tokens_default,
                                       kernels=opts.kernels, speculate=opts.speculate)
        await self.splits.start()
        self.owner.start()
        self.invite = self._ready_invite()
        await self.discovery.start()
        self.mesh.endpoint.started()  # every service has registered its stream kinds
        self.events.publish(
            "ready", api_url=self.api_url, node_id=self.key.node_id, mesh_id=self.membership.mesh_id,
            mesh_addr=self.mesh_addr, name=self.name, role=opts.role, invite=self.invite,
        )

    async def stop(self) -> None:
        """Leave the mesh gracefully and release everything, in reverse order of start."""
        if self.mesh is not None:
            self.events.publish("stopping", node_id=self.key.node_id)
        if self._server is not None:
            self._server.should_exit = True
        if self.mcp is not None:
            await self.mcp.stop()
        if self._scan_task is not None:
            self._scan_task.cancel()
        if self.discovery is not None:
            await self.discovery.stop()
        if self.owner is not None:
            await self.owner.stop()
        if self.blackboard is not None:
            await self.blackboard.stop()
        if self.routes is not None:
            self.routes.stop()
        if self.mesh is not None:
            await self.mesh.stop(graceful=True)
        if self.splits is not None:
            await self.splits.stop()
        if self.serving is not None:
            await self.serving.close()
        if self.store is not None:
            await self.store.close()
        if self._server_task is not None:
            with contextlib.suppress(asyncio.CancelledError, TimeoutError):
                await asyncio.wait_for(self._server_task, timeout=3.0)

    # -- the API --------------------------------------------------------------------------------

    async def _start_api(self) -> None:
        assert self.serving is not None
        routers = [status_router(self), console_router(),
                   metrics_router(self.serving.metrics, public=self.options.metrics_public)]
        if self.splits is not None:
            routers.append(plan_router(self.splits))
        if self.store is not None:
            routers.append(models_router(self.store, self.serving.resolve))
        if self.owner is not None:
            routers.append(owner_router(self.owner, self._node_names, self._unlock_owner))
        if self.discovery is not None:
            routers.append(discovery_router(self.discovery))
        board = self.blackboard if self.blackboard is not None else NoBoard()  # a passive client's refuses
        routers.append(blackboard_router(board))
        edge = _fit_to_descriptors(self.options.edge)
        backend = self.serving.backend
        # Off the loop: building the app (its route audit generates the OpenAPI schema) takes 0.4 s of CPU,
        # during which a joining node read no packet: on 50 processes sharing 2 cores that was 6 s in which
        # its first exchange of records (200 KB from one member) stalled, and the member's other gossip with it.
        app = await asyncio.to_thread(functools.partial(
            create_app, backend, routers=routers, access=self.access, edge=edge, policy=self.policy,
            readiness=self.readiness, on_event=self.events.publish))
        admission = app.state.admission
        self.mcp = McpEndpoint(lambda: build_server(board, self.status, backend, admission, self.events.publish))
        self.mcp.mount(app)
        sock = _bind_api_socket(self.options.api_host, self.options.api_port)
        config = uvicorn.Config(app, http=guarded_protocol(edge), backlog=ACCEPT_BACKLOG, log_level="warning",
                                lifespan="off", access_log=False)
        self._server = _EmbeddedServer(config)
        self._server_task = asyncio.create_task(self._server.serve(sockets=[sock]), name="http-api")
        deadline = time.monotonic() + 10.0
        while not self._server.started:
            if self._server_task.done() or time.monotonic() > deadline:
                raise ConfigError(f"the HTTP API did not start on {self.options.api_host}:{self.options.api_port}")
            await asyncio.sleep(0.02)
        host, port = sock.getsockname()[:2]
        self.api_url = f"http://{format_addr((host, port))}"

    def _make_discovery(self) -> NodeDiscovery:
        """Publishing and the DHT; listings describe the mesh as this node's gossip sees it."""
        assert self.membership is not None and self.mesh is not None and self.mesh.endpoint is not None
        gossip = self.mesh.gossip
        assert gossip is not None
        opts = self.options
        return NodeDiscovery(
            node_key=self.key.signing_key, node_id=self.key.node_id, node_name=self.name,
            mesh_key=self.membership.mesh_key,
            facts=lambda: facts_from_records(gossip.own, list(gossip.members().values()), time.time()),
            quic_port=self.mesh.endpoint.local_addr[1], host=opts.mesh_host, dht_bootstrap=opts.dht_bootstrap,
            dht_port=opts.dht_port, listing_ttl_s=opts.listing_ttl_s, on_event=self.events.publish,
        )

    # -- the model library ------------------------------------------------------------------------

    async def _scan_library(self) -> None:
        """Index the library's folders (hashing new files off the loop), then advertise what is there."""
        assert self.store is not None
        try:
            await asyncio.to_thread(self.store.library.scan)
        except (OSError, MeshllmError) as exc:
            log.warning("could not scan the model library: %s", exc)
        self._advertise_models()

    def _advertise_models(self) -> None:
        """Our record's ``models.available``: the whole models of the library, most recently used first."""
        assert self.mesh is not None and self.store is not None and self.mesh.gossip is not None
        entries = sorted(self.store.library.available(), key=lambda e: -e.last_used)[:MAX_AVAILABLE]
        available = [DiskModel(e.id, e.name[:200], e.size) for e in entries]
        own = self.mesh.gossip.own
        if available != own.models.available:
            self.mesh.update_own(models=msgspec.structs.replace(own.models, available=available))

    async def _start_bulk(self) -> None:
        """Open the bulk channel on the mesh's host (the UDP port's number over TCP when free) and offer it."""
        assert self.mesh is not None and self.store is not None and self.mesh.endpoint is not None
        host, port = self.options.mesh_host, self.mesh.endpoint.local_addr[1]
        try:
            bulk = await self.store.start_bulk(host, port)
        except OSError:
            try:
                bulk = await self.store.start_bulk(host, 0)
            except OSError as exc:
                log.warning("no bulk channel (model bytes ride QUIC): %s", exc.strerror)
                return
        assert self.mesh.gossip is not None
        own = self.mesh.gossip.own.addresses
        self.mesh.update_own(addresses=msgspec.structs.replace(own, bulk_port=bulk))

    def _upload_cap(self) -> float | None:
        """Bytes a second this node may send model files at (``model_upload_limit_mb_s``; None: no cap)."""
        mb_s = load_config(self.home).model_upload_limit_mb_s
        return mb_s * 1e6 if mb_s is not None else None

    def _bulk_port(self, node_id: str) -> int:
        """A peer's bulk channel port from its record (0: none known)."""
        assert self.mesh is not None and self.mesh.gossip is not None
        record = self.mesh.gossip.members().get(node_id)
        return record.addresses.bulk_port if record is not None else 0

    def _model_offers(self) -> list[Offer]:
        """Whole models peers offer, from their records; the closest holders (by RTT) first."""
        assert self.mesh is not None and self.mesh.gossip is not None
        gossip = self.mesh.gossip
        rtt = gossip.own.rtt
        offers = [Offer(node_id, rec.addresses.listen[0], m.id, m.name, m.size)
                  for node_id, rec in gossip.members().items() if rec.state == "alive" and rec.addresses.listen
                  for m in rec.models.available]
        return sorted(offers, key=lambda o: rtt[o.node_id].rtt_ms if o.node_id in rtt else 1e9)

    # -- StatusSource -----------------------------------------------------------------------------

    @property
    def mesh_addr(self) -> str:
        assert self.mesh is not None
        return self.mesh.listen_addrs()[0]

    def create_invite(self, ttl_s: float, max_uses: int) -> str:
        """A fresh invite token naming this node as the bootstrap member."""
        assert self.membership is not None and self.mesh is not None
        return self.membership.new_invite(time.time(), ttl_s, max_uses, self.mesh.invite_addrs())

    def revoke(self, kind: Literal["invite", "node"], target: str) -> dict[str, Any]:
        """Revoke an invite id or a node id in this mesh (owner only) and gossip it to every member.

        Raises ConfigError when this node does not hold the mesh key, DecodeError on a bad target.
        """
        assert self.membership is not None and self.mesh is not None
        if self.membership.mesh_key is None:
            raise ConfigError("only the node that holds the mesh key can revoke",
                              hint="ask the mesh owner's node: --api URL of the node that created the mesh")
        target = target.strip()
        if kind == "node":
            node_public_key(target)  # DecodeError unless it names a key
            if target == self.key.node_id:
                raise DecodeError("this node holds the mesh key; it cannot revoke itself")
        elif len(unb32(target)) != INVITE_ID_BYTES:
            raise DecodeError(f"{target[:20]!r} is not an invite id (16 base32 characters)",
                              hint="`meshllm invite inspect TOKEN` shows a token's invite id")
        rev = self.mesh.revoke(kind, target)
        return {"kind": rev.target_kind, "target": rev.target, "mesh_id": rev.mesh_id, "issued": rev.issued}

    def _ready_invite(self) -> str | None:
        """The owner prints a 24 h multi-use invite at start; other members cannot sign one."""
        assert self.membership is not None
        if self.membership.mesh_key is None:
            return None
        return self.create_invite(SERVE_INVITE_TTL_S, 0)

    def _owner_cert(self) -> bytes | None:
        """``node.cert`` as it is now (read again for every owner command: installing one needs no restart)."""
        path = self.home / NODE_CERT_FILE
        return path.read_bytes() if path.exists() and not self.options.ephemeral else None

    # -- owner control ------------------------------------------------------------------------------

    async def _standby_library(self) -> dict[str, str] | None:
        """``--standby``: model id -> reference of each ``--model`` it may take (resolved, not loaded)."""
        opts = self.options
        if not opts.standby:
            return None
        if opts.role != "host":
            raise ConfigError("--standby serves models on demand, so it cannot be combined with --client or --worker")
        refs = [await self.serving.resolve(spec) for spec in opts.models]
        return {ref.model_id: spec for ref, spec in zip(refs, opts.models, strict=True)}

    def _rename(self, name: str) -> None:
        assert self.mesh is not None
        self.name = name
        self.mesh.update_own(name=name)

    def _describe(self) -> dict[str, Any]:
        """What an owner ``status`` command reports about the node itself."""
        cert = self._owner_cert()
        expires = None
        if cert is not None:
            with contextlib.suppress(DecodeError, VerificationError):
                expires = open_certificate(decode_certificate(cert)).expires
        return {"node_id": self.key.node_id, "name": self.name, "version": __version__,
                "uptime_s": round(time.time() - self.started_at, 1), "certificate_expires": expires}

    def _node_names(self) -> list[tuple[str, str]]:
        """``(node id, name)`` of this node and every member it knows (for naming a command's target)."""
        assert self.mesh is not None and self.mesh.gossip is not None
        members = [(n, e.record.name) for n, e in self.mesh.gossip.state.peers.items()
                   if e.status in ("alive", "suspect") and n != self.key.node_id]
        return [(self.key.node_id, self.name), *sorted(members)]

    def _owner_key(self) -> str | None:
        """The owner key whose keystore is in this node's home (its public half: no passphrase needed)."""
        path = self.home / OWNER_KEYSTORE_FILE
        if not path.exists():
            return None
        with contextlib.suppress(KeystoreError):
            return b32(read_keystore(path).public)
        return None

    def _unlock_owner(self, passphrase: str | None) -> Any:
        """The owner key from the keystore in this node's home (for console commands; never kept)."""
        if passphrase is None:
            passphrase = obtain_passphrase(confirm=False, prompt=None)
        return unlock_keystore(self.home / OWNER_KEYSTORE_FILE, passphrase)

    def _own_model_json(self, model: Any) -> dict[str, Any]:
        """A model this node serves, with its engine's speculation figures where the engine speculates itself."""
        engine = self.serving.engines.get(model.name) if self.serving is not None else None
        spec = engine.speculation_status() if engine is not None else None
        return {**_model_json(model), **({"speculation": spec} if spec is not None else {})}

    def status(self) -> dict[str, Any]:
        """The ``/api/status`` snapshot (schema in docs/api.md)."""
        assert self.mesh is not None and self.mesh.gossip is not None and self.serving is not None
        gossip, endpoint = self.mesh.gossip, self.mesh.endpoint
        assert endpoint is not None
        peers = []
        now = time.time()
        traversal = self.mesh.traversal

        def punch_in(node_id: str) -> float | None:
            ahead = traversal.schedule.next_in(node_id, now) if traversal is not None else None
            return None if ahead is None else round(ahead, 1)

        for node_id, entry in sorted(gossip.state.peers.items(), key=lambda kv: kv[1].record.name):
            rec = entry.record
            conn = endpoint.peers.get(node_id)
            rtt = conn.rtt_ms if conn is not None else None
            if rtt is None and node_id in gossip.own.rtt:
                rtt = gossip.own.rtt[node_id].rtt_ms
            peers.append({
                "node_id": node_id, "name": rec.name, "state": entry.status,
                "changed_s": round(max(0.0, now - entry.changed), 3), "role": rec.role,
                "path": conn.path if conn is not None and conn.state == "alive" else "none",
                "rtt_ms": None if rtt is None else round(rtt, 3), "punch_in_s": punch_in(node_id),
                "models": [_model_json(m) for m in rec.models.served],
                "capacity": {"ram_bytes": rec.capacity.ram_bytes, "vram_bytes": rec.capacity.vram_bytes,
                             "cpu_cores": rec.capacity.cpu_cores, "gflops": rec.capacity.gflops},
                "load": {"in_flight": rec.load.in_flight, "queue": rec.load.queue, "tok_s": rec.load.tok_s,
                         "slots": rec.load.slots, "free_slots": rec.load.free_slots},
                "addr": (rec.addresses.listen or [""])[0], "seq": rec.seq, "signed_at": rec.signed_at,
                "standby": list(rec.standby),
                "available": [{"id": m.id, "name": m.name, "size": m.size} for m in rec.models.available],
            })
        own = gossip.own
        return {
            "node_id": self.key.node_id, "name": self.name, "mesh_id": own.mesh_id, "version": __version__,
            "role": own.role, "api_url": self.api_url, "mesh_addr": self.mesh_addr,
            "uptime_s": round(time.time() - self.started_at, 1),
            "mesh_owner": self.membership is not None and self.membership.mesh_key is not None,
            "owner_key": self._owner_key(),
            "models": [self._own_model_json(m) for m in own.models.served],
            "capacity": msgspec.structs.asdict(own.capacity), "load": msgspec.structs.asdict(own.load),
            "peers": peers,
            "rtt_matrix": {a: {b: round(ms, 3) for b, ms in row.items()} for a, row in gossip.rtt_matrix().items()},
            "links": mesh_links([own, *gossip.members().values()]),
            "splits": self.splits.status() if self.splits is not None else [],
            "stages": self.splits.stages_status() if self.splits is not None else [],
            "transfers": self.store.status() if self.store is not None else [],
            **(self.owner.status(time.time()) if self.owner is not None else {}),
            "requests": self.serving.request_counters(),
            "nat": self._nat_status(),
            "route_tables": self.routes.status() if self.routes is not None else None,
            "passive": isinstance(self.mesh, PassiveMesh),
            "local_health": self.mesh.detector.health if isinstance(self.mesh, MeshService) else None,
            "anchors": list(self.mesh.anchors) if isinstance(self.mesh, PassiveMesh) else [],
            "route_pulls": self.mesh.pull_status() if isinstance(self.mesh, PassiveMesh) else None,
            "devices": [{"name": d.name, "description": d.description, "kind": d.kind,
                         "memory_free": d.memory_free, "memory_total": d.memory_total} for d in compute_devices()],
        }


    def _nat_status(self) -> dict[str, Any]:
        """``nat``: whether peers reach this node at its own address, and where they see it."""
        traversal = self.mesh.traversal if self.mesh is not None else None
        if traversal is None:
            return {"reachability": "unknown", "observed": []}
        return {"reachability": traversal.reachability.value, "observed": traversal.observed()}


def _model_json(model: Any) -> dict[str, Any]:
    end = model.layer_end or None
    return {"name": model.name, "engine": model.engine, "context": model.context,
            "layers": [model.layer_start, end] if end else None}


def _api_keys(options: NodeOptions) -> tuple[str, ...]:
    """The API keys, checked, and checked to exist when the API is reachable from other machines."""
    keys = tuple(dict.fromkeys(check_api_key(k) for k in options.api_keys))
    if not keys and not is_loopback_host(options.api_host):
        raise ConfigError(f"the HTTP API would listen on {options.api_host}, beyond this machine, without an API key",
                          hint="pass --api-key KEY (or set MESHLLM_API_KEY), or keep the API on 127.0.0.1")
    return keys


def _fit_to_descriptors(edge: EdgeLimits) -> EdgeLimits:
    """Keep the connection cap at a quarter of the process's descriptor limit.

    The rest is for sockets accepted but not yet counted (a few backlogs' worth under a connection
    flood), connections being closed, the QUIC endpoint, models and logs.
    """
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or edge.max_connections <= soft // 4:
        return edge
    return dataclasses.replace(edge, max_connections=max(16, soft // 4))


def _bind_api_socket(host: str, port: int) -> socket.socket:
    """Bind the API's listening socket ourselves, so a busy port is a clear error, not uvicorn's exit."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # IPPROTO_TCP named explicitly: asyncio sets TCP_NODELAY only on sockets that say so, and without it
    # Nagle's algorithm held a response's second write for the client's delayed ACK (~40 ms a request)
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise ConfigError(f"cannot open the HTTP API on {host}:{port}: {exc.strerror}",
                          hint="is another node running there? pick another port with --port (0 picks a free one)") \
            from None
    sock.set_inheritable(True)
    return sock


class _EmbeddedServer(uvicorn.Server):
    """uvicorn inside our loop: the node, not uvicorn, owns SIGINT/SIGTERM."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield
