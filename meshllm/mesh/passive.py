"""A passive client's mesh driver: anchors, route-table pulls, and nothing of gossip.

``serve --client`` (joining a mesh, without ``--member``) builds this instead of
:class:`~meshllm.mesh.service.MeshService`.
It has the same face towards the rest of the node (``endpoint``, ``gossip``, ``membership``,
``admission``, ``update_own``, ...), so serving, routing, failover, replay and status run on it
unchanged; but ``gossip`` is a :class:`~meshllm.mesh.routes.PassiveView` filled from route tables
(:mod:`meshllm.mesh.routes`), and the endpoint tells every member it dials that it is passive
(``Hello.passive``), so members keep it out of gossip and never probe it.

The loop: keep :data:`~meshllm.mesh.routes.ANCHORS` connection to a member (the invite's
bootstrap address first, then a member the table lists, picked at random so clients spread over
the mesh); ask the anchor for the table every interval and at once when something suggests it is
out of date (a node we talk to failed, an anchor went); turn the table into the peer view and
report its changes as ``peer_joined``/``peer_left`` like a member does. Every wait has a deadline.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections.abc import Callable
from typing import Any

import msgspec

from meshllm.errors import ConfigError, MeshllmError, VerificationError
from meshllm.identity.keys import NodeKey
from meshllm.mesh import blackboard, view
from meshllm.mesh.blackboard import BoardRefusal, HeldNote
from meshllm.mesh.membership import Membership
from meshllm.mesh.records import Addresses, CheckTrust, PeerRecord, RecordVerifier, RttEntry
from meshllm.mesh.routes import (
    ANCHORS,
    HINT_MAX_BYTES,
    PULL_INTERVAL_S,
    ROUTES_STREAM,
    TABLE_MAX_BYTES,
    PassiveView,
    RouteBook,
    RoutesChanged,
    RoutesReply,
    TableAccepted,
    TableRefused,
    view_of,
)
from meshllm.mesh.view import PeerAdded, PeerRemoved, PeerStatus
from meshllm.net.backoff import Backoff
from meshllm.net.endpoint import Endpoint, EndpointOptions
from meshllm.net.errors import AdmissionRefused, ConnectError
from meshllm.net.events import PeerEvent, PeerEventKind
from meshllm.net.quic import ACCEPT_IDLE_TIMEOUT
from meshllm.wire.addr import format_addr, parse_addr

log = logging.getLogger(__name__)

PULL_TIMEOUT_S = 5.0
"""A pull (open, ask, whole reply) must finish within this long; else the anchor is dropped and another dialed.

Connections are probed only while they carry a request (``EndpointOptions.idle_probe_interval`` None, and
``routes`` a quiet kind): a serving node that dies mid-answer turns suspect within a second, as for a member,
while an anchor connection costs its member nothing between pulls. An anchor's liveness is its answers to
pulls, within this deadline, and the pulls keep the connection (with the long idle timeout members grant passive
dialers) and NAT bindings alive. (A pull was probed too: a ping and a pong more for every pull, on top of its
request, answer and acknowledgements.)"""
DIAL_TIMEOUT_S = 3.0
BOOTSTRAP_DEADLINE_S = 15.0
TICK_MAX_S = 0.5
IDLE_CLOSE_S = 30.0
"""A connection to a member that is not an anchor is closed after this long without a stream."""

OnEvent = Callable[..., None]


class PullOnUnmet:
    """The node's demand counter, wrapped on a passive client: while requests are routed it pulls every few
    seconds (:data:`~meshllm.mesh.routes.BUSY_INTERVAL_S`), and a request that had nowhere to go (nobody in
    the table serves the model, or every node was full) asks the anchor for a fresh table at once, so a
    model loaded since the last pull is routed to on the next request, not a minute later."""

    def __init__(self, inner: Any, mesh: PassiveMesh) -> None:
        self.inner, self.mesh = inner, mesh

    def record(self, model: str, now: float) -> None:
        self.inner.record(model, now)
        self.mesh.busy()

    def unmet(self, model: str, now: float) -> None:
        self.inner.unmet(model, now)
        self.mesh.refresh()


class NoBoard:
    """The blackboard face of a passive client: it holds no notes (gossip carries them, and it takes no part),
    so reading and posting are refused with a reason (``/api/blackboard`` answers 409, MCP's tools an error)."""

    def _refuse(self) -> BoardRefusal:
        return BoardRefusal("passive-client", "a passive client holds no blackboard: notes travel by gossip",
                            hint="start the node with --client --member to read and post notes")

    def post(self, text: str) -> HeldNote:
        raise self._refuse()

    def search(self, query: blackboard.Query) -> list[HeldNote]:
        raise self._refuse()


class PassiveMesh:
    """A passive client's place in a mesh: connections to a few members and the route table they serve."""

    def __init__(
        self,
        key: NodeKey,
        membership: Membership,
        record: PeerRecord,
        *,
        check_trust: CheckTrust,
        check_node_id: Callable[[str], None] = lambda _node_id: None,
        on_event: OnEvent,
        host: str = "0.0.0.0",
        port: int = 0,
        interval: float = PULL_INTERVAL_S,
        rng: random.Random | None = None,
    ) -> None:
        self.key = key
        self.membership = membership
        self.admission = membership.admission()
        self.verifier = RecordVerifier(membership.mesh_id, self.admission.verify_member, check_trust,
                                       forget_member=self.admission.forget)
        self._check_node_id = check_node_id
        self._on_event = on_event
        self._host, self._port = host, port
        self._rng = rng or random.SystemRandom()
        self.book = RouteBook(key.node_id, membership.mesh_id, self._rng, interval)
        self.gossip = PassiveView(record, view.empty(key.node_id))
        """Named for the query surface the node reads (``own``, ``state``, ``members()``); no gossip runs."""
        self.endpoint: Endpoint | None = None
        self.traversal = None
        """A passive client relays nobody and punches through nothing: it dials members' addresses."""
        self.anchors: list[str] = []
        """Members we keep connections to and pull from, the first asked first."""
        self.pulls = 0
        self._listen: list[str] = []
        self._dialing: asyncio.Task[None] | None = None
        self._pulling: asyncio.Task[None] | None = None
        self._bootstrap_anchor: str | None = None
        """The member we joined through, until the table offers enough others to draw from."""
        self._passed_over: str | None = None
        """The invite's member when the draw passed it over: not redrawn, so every member's odds are equal."""
        self._shunned: set[str] = set()
        """Members whose tables we refused: not drawn as anchors again while others remain."""
        self._idle_since: dict[str, float] = {}
        self._dial_backoff = Backoff(0.2, 2.0, 5.0)
        self._not_before = 0.0
        self._runner: asyncio.Task[None] | None = None
        self._wake = asyncio.Event()

    # -- lifecycle ------------------------------------------------------------------------------

    async def start(self) -> None:
        """Bind the endpoint, reach a member (the first anchor) and pull the first table."""
        if not self.membership.bootstrap:
            raise ConfigError("a passive client needs a member to connect to",
                              hint="join with an invite (or --bootstrap HOST:PORT)")
        options = EndpointOptions(passive=True, idle_probe_interval=None, idle_timeout=ACCEPT_IDLE_TIMEOUT,
                                  quiet_kinds=frozenset({ROUTES_STREAM}))
        try:
            self.endpoint = await Endpoint.create(
                self.key.signing_key, self._host, self._port, admit=self._admit,
                local_proof=lambda: self.membership.proof, options=options, take_grant=self._take_grant)
        except OSError as exc:
            raise ConfigError(f"cannot open the mesh's UDP port {self._host}:{self._port}: {exc.strerror}",
                              hint="pick another port with --mesh-port (0 picks a free one)") from None
        self.endpoint.on_peer_event(self._on_peer_event)
        self.endpoint.on_datagram = self._on_datagram
        host, port = self.endpoint.local_addr[:2]
        self._listen = [format_addr(("127.0.0.1" if host in ("0.0.0.0", "::") else host, port))]
        self.gossip.update_own(time.time(), addresses=Addresses(listen=self._listen))
        first = await self._bootstrap(self.membership.bootstrap)
        self.anchors.append(first)
        self._bootstrap_anchor = first
        self._on_event("anchor_connected", node_id=first)
        await self._pull()
        self._runner = asyncio.create_task(self._run(), name="passive-mesh")

    async def stop(self, graceful: bool = True) -> None:
        """Close every connection; nobody holds a record of us, so there is nothing to announce."""
        del graceful
        for task in [self._runner, self._dialing, self._pulling]:
            if task is not None:
                task.cancel()
        if self.endpoint is not None:
            await self.endpoint.close()

    # -- the face the node reads ----------------------------------------------------------------

    @property
    def node_id(self) -> str:
        return self.key.node_id

    def listen_addrs(self) -> list[str]:
        assert self._listen, "the passive mesh has not started"
        return list(self._listen)

    def invite_addrs(self) -> list[str]:
        """A passive client admits nobody: invites it relays name its anchors' addresses."""
        return [a for n in self.anchors for a in self.book.addresses(n)] or list(self.membership.bootstrap)

    def update_own(self, **changes: Any) -> None:
        """Our record is local only (nobody holds it): serving and splits read it as on a member."""
        self.gossip.update_own(time.time(), **changes)

    def revoke(self, kind: str, target: str) -> Any:
        raise ConfigError("only the node that holds the mesh key can revoke", hint="ask the mesh owner's node")

    def pull_status(self) -> dict[str, float]:
        """``route_pulls`` in ``/api/status``: tables pulled, and how soon the next pull is due (seconds)."""
        return {"pulls": self.pulls, "next_s": round(max(0.0, self.book.next_timer() - time.time()), 2)}

    def busy(self) -> None:
        """A request is being routed: keep the table fresh while the client is in use."""
        self.book.busy(time.time())
        self._wake.set()

    def refresh(self) -> None:
        """Ask an anchor for the table soon (on demand: a model nobody serves, a node that failed)."""
        if self.book.on_demand(time.time()):
            self._wake.set()

    # -- admission ---------------------------------------------------------------------------------

    def _admit(self, peer_id: str, proof: bytes, dialer: bool) -> bytes | None:
        self._check_node_id(peer_id)
        if not dialer:
            raise VerificationError("this node is a passive client: it accepts no connections",
                                    hint="passive clients dial members; members never dial them")
        self.admission.standing(peer_id, proof, time.time())  # a good credential; counted nowhere
        return None

    def _take_grant(self, peer_id: str, grant: bytes) -> None:
        if self.membership.granted:
            return
        if not grant:
            raise VerificationError(f"member {peer_id[:8]} accepted us without a grant",
                                    hint="join through another member (it may run an older meshllm)")
        if self.membership.take_grant(self.node_id, peer_id, grant, time.time()):
            self.gossip.update_own(time.time(), membership_proof=self.membership.proof)
            self._on_event("admitted", admitter=peer_id)

    # -- the loop ----------------------------------------------------------------------------------

    async def _run(self) -> None:
        while True:
            now = time.time()
            try:
                self._keep_anchors(now)
                if self.book.due(now) and (self._pulling is None or self._pulling.done()):
                    self._pulling = asyncio.create_task(self._pull(), name="route-pull")
                self._install(now)
            except Exception:
                log.exception("passive mesh tick failed")
            wait = max(0.0, self.book.next_timer() - time.time())
            self._wake.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), timeout=min(wait, TICK_MAX_S))

    def _keep_anchors(self, now: float) -> None:
        """Drop anchors whose connection went; dial a new one while we hold fewer than ANCHORS.

        The invite's member is only the way in: once the table lists enough members, it stays an
        anchor only if drawn like any other, so clients spread over the mesh instead of all holding a
        connection to the node that printed the invite. Connections that are neither anchors nor in
        use (a serving node we sent requests to) are closed after :data:`IDLE_CLOSE_S`.
        """
        assert self.endpoint is not None
        self.anchors = [a for a in self.anchors if a in self.endpoint.peers]
        self._close_idle(now)
        members = len(self.book.anchor_candidates([]))
        if self._bootstrap_anchor in self.anchors and len(self.anchors) >= ANCHORS and members > ANCHORS:
            if self._rng.random() >= ANCHORS / members:  # kept with the odds any member has of being drawn
                self.anchors.remove(self._bootstrap_anchor)  # its connection closes once idle
                self._passed_over = self._bootstrap_anchor  # and it is not drawn again in its place
            self._rng.shuffle(self.anchors)  # which anchor answers pulls: a random one, not the invite's
            self._bootstrap_anchor = None
        if len(self.anchors) >= ANCHORS or now < self._not_before:
            return
        if self._dialing is not None and not self._dialing.done():
            return
        skip = [*self.anchors, *filter(None, [self._passed_over])]
        candidates = self.book.anchor_candidates([*skip, *self._shunned]) or self.book.anchor_candidates(skip)
        self._dialing = asyncio.create_task(self._add_anchor(candidates), name="anchor-dial")

    def _close_idle(self, now: float) -> None:
        assert self.endpoint is not None
        for peer, conn in list(self.endpoint.peers.items()):
            if peer in self.anchors or conn.streams_open:
                self._idle_since.pop(peer, None)
                continue
            since = self._idle_since.setdefault(peer, now)
            if now - since > IDLE_CLOSE_S:
                conn.close("idle: not an anchor, no requests")
                self._idle_since.pop(peer, None)

    async def _add_anchor(self, candidates: list[str]) -> None:
        assert self.endpoint is not None
        for peer in candidates[:4]:
            for text in self.book.addresses(peer):
                try:
                    await self.endpoint.connect(parse_addr(text), expected_node_id=peer, timeout=DIAL_TIMEOUT_S)
                except MeshllmError as exc:
                    log.debug("anchor dial %s at %s failed: %s", peer[:8], text, exc)
                    continue
                self.anchors.append(peer)
                self._dial_backoff.reset()
                self._on_event("anchor_connected", node_id=peer)
                if len(self.anchors) == 1:
                    self.book.on_demand(time.time())  # our only anchor is new: ask it at once
                return
        if not self.anchors:  # cut off from every member we knew: the invite's members again
            with contextlib.suppress(MeshllmError):
                peer = await self._bootstrap(self.membership.bootstrap, deadline_s=DIAL_TIMEOUT_S)
                self.anchors.append(peer)
                self._on_event("anchor_connected", node_id=peer)
                return
        self._not_before = time.time() + self._dial_backoff.next_delay()

    async def _pull(self) -> None:
        """Ask the anchors in turn until one answers within its deadline."""
        assert self.endpoint is not None
        self.book.pulled(time.time())
        # The first anchor answers while it can: a table's version is its issuer's, so alternating
        # anchors would fetch a whole table every time. Clients spread because anchors are drawn at random.
        for anchor in list(self.anchors):
            conn = self.endpoint.peers.get(anchor)
            if conn is None:
                continue
            try:
                stream = await asyncio.wait_for(conn.open_stream(ROUTES_STREAM, max_frame=TABLE_MAX_BYTES + 4096),
                                                PULL_TIMEOUT_S)
                try:
                    await stream.send(self.book.ask(), timeout=PULL_TIMEOUT_S)
                    stream.close()
                    reply = await stream.recv(RoutesReply, timeout=PULL_TIMEOUT_S)
                finally:
                    stream.close()
            except (MeshllmError, TimeoutError, msgspec.DecodeError, msgspec.ValidationError) as exc:
                self._on_event("routes_refused", issuer=anchor, reason=f"pull failed: {exc}")
                conn.close(f"route pull failed: {exc}")  # its probes are slow: a failed pull is how we learn
                continue
            if reply is None:
                continue
            self.pulls += 1
            outcome = self.book.receive(anchor, reply, time.time())
            if isinstance(outcome, TableRefused):
                log.warning("refused a route table from %s: %s", anchor[:8], outcome.reason)
                self._on_event("routes_refused", issuer=anchor, reason=outcome.reason)
                self._shun(anchor)
                continue
            if isinstance(outcome, TableAccepted):
                self._on_event("routes_updated", issuer=anchor, version=outcome.version,
                               nodes=len(self.book.entries(time.time())), added=outcome.added, removed=outcome.removed)
            self._install(time.time())
            return

    def _shun(self, anchor: str) -> None:
        """``anchor`` sent a table we refused: ask another member from now on (its connection closes once idle)."""
        if anchor in self.anchors:
            self.anchors.remove(anchor)
        self._shunned.add(anchor)
        self.book.on_demand(time.time())

    def _install(self, now: float) -> None:
        """The table held, as our peer view and our RTT row; changes reported as a member reports them."""
        assert self.endpoint is not None
        for event in self.gossip.replace_state(view_of(self.book, self.gossip.state, now)):
            if isinstance(event, PeerAdded):
                self._on_event("peer_joined", node_id=event.node_id, name=event.record.name)
            elif isinstance(event, PeerRemoved):
                self._on_event("peer_left", node_id=event.node_id, reason=event.reason)
            elif isinstance(event, PeerStatus):
                self._on_event("peer_state", node_id=event.node_id, state=event.status)
        self._own_rtt()

    def _own_rtt(self) -> None:
        """Our RTT to each node: measured where we hold a connection, else via the anchor that issued the table."""
        assert self.endpoint is not None
        table = self.book.table
        issuer_conn = self.endpoint.peers.get(table.issuer) if table is not None else None
        via = issuer_conn.rtt_ms if issuer_conn is not None else None
        row: dict[str, RttEntry] = {}
        for entry in self.book.entries(time.time()):
            conn = self.endpoint.peers.get(entry.node_id)
            if conn is not None and conn.rtt_ms is not None:
                row[entry.node_id] = RttEntry(conn.rtt_ms, "direct")
            elif entry.rtt_ms is not None and via is not None:
                row[entry.node_id] = RttEntry(entry.rtt_ms + via, "relay")
        if row != self.gossip.own.rtt:
            self.gossip.own = msgspec.structs.replace(self.gossip.own, rtt=row)

    async def _bootstrap(self, addrs: list[str], deadline_s: float = BOOTSTRAP_DEADLINE_S) -> str:
        """Connect to one of the invite's members; a refusal is final, silence is retried until the deadline."""
        assert self.endpoint is not None
        deadline = time.monotonic() + deadline_s
        backoff = Backoff()
        errors: list[str] = []
        while time.monotonic() < deadline:
            for text in addrs:
                try:
                    conn = await self.endpoint.connect(parse_addr(text), timeout=DIAL_TIMEOUT_S)
                    assert conn.node_id is not None
                    return conn.node_id
                except AdmissionRefused:
                    raise
                except (ConnectError, MeshllmError, OSError) as exc:
                    errors.append(f"{text}: {exc}")
            await asyncio.sleep(min(backoff.next_delay(), max(0.0, deadline - time.monotonic())))
        raise ConnectError(
            f"could not reach any member of {self.membership.mesh_id} at {', '.join(addrs)}",
            hint="check that a member is running and reachable at the invite's addresses "
                 f"(last error: {errors[-1] if errors else 'none'})")

    def _on_datagram(self, conn: Any, data: bytes) -> None:
        """A member's hint that the mesh changed (``RoutesChanged``): pull now if it is our anchor's and names
        a version we lack. Other members' hints (a serving node we sent requests to) name their own tables'
        versions, so they are not followed; anything but a hint is a strike."""
        try:
            if len(data) > HINT_MAX_BYTES:
                raise msgspec.DecodeError(f"{len(data)} bytes")
            hint = msgspec.msgpack.decode(data, type=RoutesChanged)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            conn.strike(f"a datagram that is no route hint: {exc}")
            return
        if conn.node_id in self.anchors and self.book.hinted(hint, time.time()):
            self._wake.set()

    def _on_peer_event(self, event: PeerEvent) -> None:
        """A connection went or turned suspect: the node may be gone, so ask for the table now."""
        if event.kind in (PeerEventKind.CLOSED, PeerEventKind.SUSPECT):
            if event.node_id in self.anchors:
                self.anchors.remove(event.node_id)
                self._on_event("anchor_lost", node_id=event.node_id, reason=event.reason or event.kind.value)
            self.refresh()
        self._wake.set()

