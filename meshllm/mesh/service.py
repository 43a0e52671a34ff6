"""The mesh service: the asyncio driver that runs gossip and failure detection over QUIC.

The protocol logic lives in sans-IO cores (:mod:`.gossip`, :mod:`.failure`, :mod:`.admission`);
this module only moves their messages over the endpoint's ``gossip`` streams, feeds them the
clock and the transport's peer events, keeps connections to the peers the gossip core wants,
and reports what changed through an ``on_event(type, **fields)`` callback (the node turns those
into log lines and ``/api/events``). Each gossip message travels on a stream of its own: QUIC
streams are cheap, and a lost or slow one never holds up another.

Admission of a connecting peer (see docs/architecture.md): a peer that dials us either holds a
good credential already (a grant from a member) or must present an invite that is live now, and
then gets a grant from us in the Welcome (:meth:`AdmissionState.admit`); a peer we dial is checked
with :meth:`AdmissionState.verify_member`. The grant we are given when we join completes our own
credential (:meth:`Membership.take_grant`) before our record is first gossiped.

Revocations: the mesh-key holder signs one with :meth:`MeshService.revoke`; the gossip core
verifies every revocation it hears with :meth:`AdmissionState.apply_revocation` (so admission
refuses the revoked node or invite from then on), floods it, and the driver closes any connection
to a revoked node.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import random
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec

from meshllm.config import write_private
from meshllm.errors import ConfigError, DecodeError, MeshllmError, VerificationError
from meshllm.identity.keys import NodeKey
from meshllm.identity.signing import encode_signed
from meshllm.mesh.admission import Revocation, RevocationTarget, credential_invite_id, make_grant
from meshllm.mesh.failure import Failed, FailureDetector, Overstep, Probe
from meshllm.mesh.gossip import AccuserBanned, Gossip, Rejected, RevocationApplied, Send
from meshllm.mesh.membership import Membership
from meshllm.mesh.messages import PROBE_MESSAGES, MeshMessage, decode_message, encode_message
from meshllm.mesh.records import Addresses, CheckTrust, PathKind, PeerRecord, RecordVerifier
from meshllm.mesh.traversal import Traversal, parse_relay_entry
from meshllm.mesh.view import PeerAdded, PeerRemoved, PeerStatus, RecordUpdated, ViewEvent
from meshllm.net.backoff import Backoff
from meshllm.net.endpoint import Endpoint, EndpointOptions
from meshllm.net.errors import AdmissionRefused, ConnectError, NetTimeout, StreamClosed
from meshllm.net.events import PeerEvent, PeerEventKind
from meshllm.net.interfaces import lan_addresses
from meshllm.net.messages import ResetCode
from meshllm.net.nat import RelayMode
from meshllm.tasks import spawn
from meshllm.wire.addr import format_addr, parse_addr

log = logging.getLogger(__name__)

GOSSIP_STREAM = "gossip"
DATAGRAM_MESSAGE_MAX = 1000
"""Mesh messages up to this many bytes travel as one QUIC datagram (probes, summaries, small digests, down
notices); larger ones (records, about 1.6 KB with their membership proof) on a stream of their own."""
HEARD_S = 0.5
"""A suspect whose connection delivered a packet this recently is alive (``_heard_suspects``)."""
STALE_LINK_S = 5.0
"""A member that joins or comes back while our connection to it has been silent this long gets a new one
(``_report``): that connection belongs to its earlier life (killed and restarted) or to a broken path."""
TICK_MAX_S = 0.1
"""Longest sleep between core ticks: bounds how late a timer fires."""
SEND_TIMEOUT_S = 2.0
"""Deadline for queueing one gossip message."""
RECV_TIMEOUT_S = 10.0
"""Deadline for a gossip stream's one message to arrive, whole (a peer dripping it is struck by the
transport's frame deadline first)."""
DRAIN_TIMEOUT_S = 10.0
"""A gossip message must have left within this long: a peer that grants no credit gets a strike."""
SEND_BYTES_IN_FLIGHT = 8 * 1024 * 1024
"""Bytes of gossip to one peer that may be waiting to leave; more messages are dropped (gossip
repairs itself). Only a peer that lets a message sit past DRAIN_TIMEOUT_S gets a strike."""
DIAL_TIMEOUT_S = 3.0
BOOTSTRAP_DEADLINE_S = 15.0
FIRST_VIEW_S = 5.0
"""Longest a joining node's start waits for a member to answer its first want list (:meth:`MeshService.first_view`)."""
FIRST_VIEW_POLL_S = 0.02
DIALS_IN_FLIGHT = 4
"""Member dials at once (one while our local health is not 0)."""
PRUNE_AFTER_S = 30.0
"""A connection we dialed and no longer want is closed after this long unwanted (a rotation that comes
back within it keeps the connection)."""
RECORD_PATHS: dict[str, PathKind] = {"direct": "direct", "punched": "punched", "relayed": "relay"}
"""Connection path type -> the path kind published in our record's RTT row."""

OnEvent = Callable[..., None]


class MeshService:
    """One node's membership in a mesh: endpoint, gossip, failure detection, connections."""

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
        announce: list[str] | None = None,
        endpoint_options: EndpointOptions | None = None,
        rng: random.Random | None = None,
        relay: RelayMode = "auto",
        revocations_file: Path | None = None,
    ) -> None:
        self.key = key
        self.membership = membership
        self.admission = membership.admission()
        self._check_node_id = check_node_id
        """Local trust checks that need no certificate (revoked ids, allowlist), run at admission."""
        self.verifier = RecordVerifier(membership.mesh_id, self.admission.verify_member, check_trust,
                                       forget_member=self.admission.forget)
        self._record_template = record
        self._on_event = on_event
        self._silent_s: dict[str, float] = {}
        """peer -> seconds its connection had been silent when our detector declared it down (for its event)"""
        self._host, self._port = host, port
        self._announce = list(announce or [])
        # Between members the transport probes only connections that carry work (a request, a stage lane,
        # a fetch: a peer dying mid-answer is suspect within a second). The failure detector watches the
        # rest, and QUIC's own RTT measures them: an idle member's cost is its detector's 4 pings a
        # second, not 4 probes a second each way on every connection.
        options = endpoint_options or EndpointOptions()
        self._endpoint_options = dataclasses.replace(
            options, idle_probe_interval=None, quiet_kinds=options.quiet_kinds | {GOSSIP_STREAM})
        self._rng = rng or random.SystemRandom()  # probe nonces and peer choices must not be predictable
        self._relay_mode: RelayMode = relay
        self._revocations_file = revocations_file
        self._listen: list[str] = []
        self._revocations_dirty = False
        """Where verified revocations are kept across restarts (None: memory only)."""
        self.endpoint: Endpoint | None = None
        self.traversal: Traversal | None = None
        self.gossip: Gossip | None = None
        self.detector = FailureDetector(self._rng, time.time())
        self._dialing: dict[str, asyncio.Task[None]] = {}
        self._relay_dialing: dict[str, asyncio.Task[None]] = {}
        self._backoff: dict[str, tuple[Backoff, float]] = {}
        self._unwanted: dict[str, float] = {}
        """Peers we dialed and no longer want -> since when (closed after PRUNE_AFTER_S)."""
        self._relay_backoff: dict[str, tuple[Backoff, float]] = {}
        self._rebootstrap: tuple[Backoff, float, asyncio.Task[None] | None] = (Backoff(0.5, 2.0, 5.0), 0.0, None)
        self._tasks: set[asyncio.Task[Any]] = set()
        self._in_flight: dict[str, int] = {}
        """Bytes of gossip per peer that have not left yet (bounded by SEND_BYTES_IN_FLIGHT)."""
        self._runner: asyncio.Task[None] | None = None
        self._wake = asyncio.Event()
        self._stopping = False
        self.on_change: list[Callable[[], None]] = []
        """Called on the loop on every change of our view and of our own models (route tables hint passive
        clients from it)."""

    # -- lifecycle ------------------------------------------------------------------------------

    async def start(self) -> None:
        """Bind the endpoint, start the cores, and (when joining) reach a bootstrap member."""
        try:
            self.endpoint = await Endpoint.create(
                self.key.signing_key, self._host, self._port,
                admit=self._admit, local_proof=lambda: self.membership.proof, options=self._endpoint_options,
                take_grant=self._take_grant,
            )
        except OSError as exc:
            raise ConfigError(f"cannot open the mesh's UDP port {self._host}:{self._port}: {exc.strerror}",
                              hint="is another node running there? pick another port with --mesh-port "
                                   "(0 picks a free one)") from None
        self.endpoint.admit_passive = self._admit_passive
        self.endpoint.patience = self.detector.stretch
        self.endpoint.on_datagram = self._on_datagram
        self.endpoint.on_stream(GOSSIP_STREAM, self._serve_gossip)
        self.endpoint.on_cool_down = lambda peer, reason: self._on_event("peer_cooled", node_id=peer, reason=reason)
        self.traversal = Traversal(self.endpoint, self._relay_mode, bool(self._announce), self._on_event)
        self.endpoint.on_peer_event(self._on_peer_event)
        self._listen = self._bound_addrs()
        record = msgspec.structs.replace(
            self._record_template, addresses=Addresses(listen=self._listen),
            seq=max(self._record_template.seq, int(time.time() * 1000)),
        )
        self.gossip = Gossip(self.key.signing_key, record, self.verifier, self._rng, time.time(),
                             verify_revocation=self.admission.apply_revocation)
        self._load_revocations()
        self._runner = asyncio.create_task(self._run(), name="mesh-service")
        if self.membership.bootstrap:
            await self._bootstrap(self.membership.bootstrap)

    def listen_addrs(self) -> list[str]:
        """Addresses peers can dial us at (worked out once, when the endpoint was bound)."""
        assert self._listen, "the mesh service has not started"
        return list(self._listen)

    def _bound_addrs(self) -> list[str]:
        """Announced addresses, else the bound one; a wildcard bind lists this machine's LAN
        addresses, then loopback (for nodes on the same host)."""
        assert self.endpoint is not None
        if self._announce:
            return list(self._announce)
        host, port = self.endpoint.local_addr[:2]
        if host in ("0.0.0.0", "::"):
            return [format_addr((ip, port)) for ip in [*lan_addresses(), "127.0.0.1"]]
        return [format_addr((host, port))]

    def invite_addrs(self) -> list[str]:
        """Addresses a joiner may bootstrap from: ours, our public ones, and our relays'.

        A node behind a NAT cannot be dialed at its own addresses, but its relay is a member too,
        so an invite naming the relay still gets a joiner in (no change to the invite format).
        """
        assert self.traversal is not None
        relays = [format_addr(addr) for _, (addr, _) in sorted(self.traversal.reservations.items())]
        return list(dict.fromkeys([*self.listen_addrs(), *self.traversal.observed(), *relays]))

    async def stop(self, graceful: bool = True) -> None:
        """Leave the mesh: send a signed ``leaving`` record to connected peers, then close."""
        self._stopping = True
        if graceful and self.gossip is not None and self.endpoint is not None:
            sends = [o for o in self.gossip.leave(time.time()) if isinstance(o, Send)]
            await asyncio.wait_for(
                asyncio.gather(*(self._send(s.to, s.message) for s in sends), return_exceptions=True),
                timeout=1.0,
            )
        for task in [self._runner, *self._dialing.values(), *self._relay_dialing.values(), *self._tasks]:
            if task is not None:
                task.cancel()
        if self.traversal is not None:
            await self.traversal.close()
        if self.endpoint is not None:
            await self.endpoint.close()

    # -- queries ---------------------------------------------------------------------------------

    @property
    def node_id(self) -> str:
        return self.key.node_id

    def update_own(self, **changes: Any) -> None:
        """Change fields of our record (models, load, ...); gossip spreads the new version."""
        assert self.gossip is not None
        self.gossip.update_own(time.time(), **changes)
        if "models" in changes:  # what our passive clients route on; loads change with every request
            self._changed()
        self._wake.set()

    def _changed(self) -> None:
        for listener in self.on_change:
            listener()

    def revoke(self, kind: RevocationTarget, target: str) -> Revocation:
        """Sign a revocation with the mesh key, apply it here and spread it to every member.

        Call it from the event loop (it changes the gossip core). Raises ConfigError when this node
        does not hold the mesh key.
        """
        assert self.gossip is not None
        mesh_key = self.membership.mesh_key
        if mesh_key is None:
            raise ConfigError("only the node that holds the mesh key can revoke",
                              hint="ask the mesh owner's node (--api URL of the node that created the mesh)")
        now = time.time()
        entry = self.gossip.state.peers.get(target) if kind == "node" else None
        closes = (credential_invite_id(entry.record.membership_proof) or "") if entry is not None else ""
        signed = mesh_key.revoke(kind, target, now, closes)
        self._handle(self.gossip.add_revocation(encode_signed(signed), now))
        self._wake.set()
        return Revocation(mesh_key.mesh_id, kind, target, now, closes)

    # -- admission ---------------------------------------------------------------------------------

    def _admit(self, peer_id: str, proof: bytes, dialer: bool) -> bytes | None:
        """The endpoint's admission check; returns the grant for a node joining through us."""
        now = time.time()
        self._check_node_id(peer_id)
        if dialer:
            self.admission.verify_member(peer_id, proof, now)
            return None
        if not self.membership.granted:
            raise VerificationError("this node has not been admitted itself yet",
                                    hint="join through another member")
        owner = self.membership.mesh_key is not None
        invite = self.admission.admit(peer_id, proof, now, quota_for=None if owner else self.node_id)
        if invite is None:
            return None
        return make_grant(self.key.signing_key, self.membership.proof, self.membership.mesh_id, peer_id,
                          invite.invite_id, now)

    def _admit_passive(self, peer_id: str, proof: bytes, dialer: bool) -> bytes | None:
        """A passive client dialed us: a good credential, or a live invite (then we grant). It takes a use of
        a limited invite (counted here, without its id) but no admitter's quota: quotas bound what enters
        every member's view, and a passive client enters none; should its key ever publish a record, every
        member counts it then (``verify_member``)."""
        now = time.time()
        self._check_node_id(peer_id)
        try:
            self.admission.standing(peer_id, proof, now)
            return None
        except VerificationError:
            pass  # no grant yet: the invite decides
        if not self.membership.granted:
            raise VerificationError("this node has not been admitted itself yet", hint="join through another member")
        invite = self.admission.admit(peer_id, proof, now, quota_for=None, passive=True)
        if invite is None:
            return None
        return make_grant(self.key.signing_key, self.membership.proof, self.membership.mesh_id, peer_id,
                          invite.invite_id, now)

    def _take_grant(self, peer_id: str, grant: bytes) -> None:
        """A member we dialed accepted us: keep its grant as our credential (the first one only)."""
        if self.membership.granted:
            return
        if not grant:
            raise VerificationError(f"member {peer_id[:8]} accepted us without a grant",
                                    hint="join through another member (it may run an older meshllm)")
        now = time.time()
        if self.membership.take_grant(self.node_id, peer_id, grant, now) and self.gossip is not None:
            self.gossip.update_own(now, membership_proof=self.membership.proof)
            self._on_event("admitted", admitter=peer_id)

    # -- the loop ----------------------------------------------------------------------------------

    async def _run(self) -> None:
        assert self.gossip is not None
        while True:
            now = time.time()
            try:
                self._handle(self.gossip.tick(now, 1 + self.detector.health))
                self._handle(self.gossip.on_detector(self._probe(self._heard_suspects()), now))
                watched = sorted(self.gossip.watched())
                self._handle(self.gossip.on_detector(
                    [e for e in self._probe(self.detector.tick(now, watched))], now))
                self._silent_s.clear()  # read by the events of those verdicts, reported just now
                self._observe_rtts(now)
                self._maintain_connections(now)
                self._maintain_traversal(now)
            except Exception:
                log.exception("mesh service tick failed")
            wait = max(0.0, min(self.gossip.next_timer(), self.detector.next_timer()) - time.time())
            self._wake.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), timeout=min(wait, TICK_MAX_S))

    def _heard_suspects(self) -> list[Any]:
        """Clear the suspicion of every suspect whose connection delivered a packet within :data:`HEARD_S`.

        Any packet from a peer was sent by its event loop, the one that answers our pings: it is alive,
        whatever became of the pings (datagrams held back by congestion control, lost answers). Under
        churn on a saturated host, 12 of 30 verdicts sampled named a peer heard within the last 0.4 s.
        """
        assert self.endpoint is not None
        out: list[Any] = []
        for node in self.detector.suspects:
            conn = self.endpoint.peers.get(node)
            if conn is not None and conn.silent_s < HEARD_S:
                out += self.detector.alive(node)
        return out

    def _probe(self, outputs: list[Any]) -> list[Any]:
        """Send the detector's probes; return its verdicts for the gossip core."""
        verdicts = []
        for out in outputs:
            if isinstance(out, Probe):
                self._deliver(out.to, out.message)
            elif isinstance(out, Overstep):
                self._overstep(out)
            else:
                if isinstance(out, Failed):  # our own verdict: the connection went silent, so it goes too
                    conn = self.endpoint.peers.get(out.node_id) if self.endpoint is not None else None
                    if conn is not None:
                        self._silent_s[out.node_id] = conn.silent_s
                    self._close_peer(out.node_id, "no answer to the failure detector's probes")
                verdicts.append(out)
        return verdicts

    def _overstep(self, out: Overstep) -> None:
        """A peer overstepped a gossip limit: a strike on its connection (enough cool it down)."""
        assert self.endpoint is not None
        conn = self.endpoint.peers.get(out.peer)
        if conn is not None:
            conn.strike(out.reason)

    def _handle(self, outputs: list[Any]) -> None:
        self._handle_outputs(outputs)
        if self._revocations_dirty:  # one write for a whole batch of new revocations
            self._revocations_dirty = False
            self._save_revocations()

    def _handle_outputs(self, outputs: list[Any]) -> None:
        for out in outputs:
            if isinstance(out, Send):
                self._deliver(out.to, out.message)
            elif isinstance(out, Rejected):
                log.warning("dropped gossip from %s: %s: %s", out.source[:8], type(out.error).__name__, out.error)
                self._on_event("record_rejected", source=out.source, error=type(out.error).__name__,
                               reason=str(out.error))
            elif isinstance(out, RevocationApplied):
                self._on_revocation(out)
            elif isinstance(out, Overstep):
                self._overstep(out)
            elif isinstance(out, AccuserBanned):
                log.warning("ignoring down notices from %s for a while: too many were refuted", out.node_id[:8])
                self._on_event("accuser_banned", node_id=out.node_id)
            else:
                self._report(out)

    def _load_revocations(self) -> None:
        """Re-apply the revocations saved by an earlier run, before any peer can connect."""
        if self._revocations_file is None or not self._revocations_file.exists():
            return
        assert self.gossip is not None
        try:
            saved = msgspec.msgpack.decode(self._revocations_file.read_bytes(), type=list[bytes])
        except (OSError, msgspec.DecodeError, msgspec.ValidationError) as exc:
            log.warning("ignoring unreadable %s: %s", self._revocations_file, exc)
            return
        for raw in saved:
            try:
                self._handle_outputs(self.gossip.add_revocation(raw, time.time()))
            except MeshllmError as exc:  # another mesh's, or damaged: it does not apply here
                log.warning("ignoring a saved revocation: %s", exc)
        self._revocations_dirty = False  # nothing new to write back

    def _save_revocations(self) -> None:
        if self._revocations_file is None or self.gossip is None:
            return
        try:
            write_private(self._revocations_file, msgspec.msgpack.encode(list(self.gossip.revocations)))
        except OSError as exc:
            log.warning("cannot save revocations to %s: %s", self._revocations_file, exc)

    def _on_revocation(self, rev: RevocationApplied) -> None:
        self._revocations_dirty = True
        self._on_event("revoked", kind=rev.kind, target=rev.target,
                       source=rev.source if rev.source is not None else self.node_id)
        if rev.kind != "node":
            return
        if rev.target == self.node_id:
            log.warning("the mesh owner revoked this node (%s): members will refuse it", self.node_id[:8])
            return
        self.detector.forget(rev.target)
        self._close_peer(rev.target, "node revoked by the mesh owner")

    def _report(self, event: ViewEvent) -> None:
        self._changed()
        if isinstance(event, PeerAdded):
            self._on_event("peer_joined", node_id=event.node_id, name=event.record.name)
            conn = self.endpoint.peers.get(event.node_id) if self.endpoint is not None else None
            if conn is not None and conn.silent_s > STALE_LINK_S:
                # A down notice leaves connections open (below), and a dead peer's then lingers for QUIC's
                # idle timeout, minutes when a loaded host's PTO grows (3 PTOs at least). Had the peer come
                # back on it, it would have spoken; our detector probing into it would condemn the new life.
                self._close_peer(event.node_id, "silent since before the peer came back")
        elif isinstance(event, PeerRemoved):
            self.detector.forget(event.node_id)
            if event.reason != "down":
                # A down notice from another member leaves our connection to end by itself (QUIC's idle
                # timeout, 20 s or more; our own verdicts close it in _probe): if the peer is dead it carries
                # nothing, and if the verdict was wrong (a loaded host) the peer's refutation revives it
                # with the connection and its RTT in place, not with a redial from every member that
                # held one. On 50 members sharing two cores those redials kept a storm of false downs
                # going (docs/benchmarks.md).
                self._close_peer(event.node_id, f"peer is {event.reason}")
            # who said so, and if we did, how long its connection had been silent: what an operator needs to
            # tell a death from a verdict against a live but overloaded node
            accuser = self.gossip.accuser(event.node_id) if event.reason == "down" and self.gossip else None
            silent = self._silent_s.pop(event.node_id, None)
            self._on_event("peer_left", node_id=event.node_id, reason=event.reason,
                           **({"accuser": accuser} if accuser else {}),
                           **({"silent_s": round(silent, 2)} if silent is not None and accuser == self.node_id else {}))
        elif isinstance(event, PeerStatus):
            self._on_event("peer_state", node_id=event.node_id, state=event.status)
        elif isinstance(event, RecordUpdated):
            self._on_event("record_updated", node_id=event.node_id, seq=event.record.seq)

    def _observe_rtts(self, now: float) -> None:
        """The path RTT (QUIC's minimum) to each member of our view. Walks the view, not our connections: passive
        clients' connections (hundreds, perhaps) enter no record, and cost nothing per tick."""
        assert self.gossip is not None and self.endpoint is not None
        peers = self.endpoint.peers
        for peer_id in self.gossip.state.peers:
            conn = peers.get(peer_id)
            if conn is not None and not conn.passive and (ms := conn.path_rtt_ms) is not None:
                self.gossip.observe_rtt(peer_id, ms, RECORD_PATHS[conn.path], now)

    def _maintain_traversal(self, now: float) -> None:
        """Reservations and punches; publish our observed addresses and relays when they change."""
        assert self.gossip is not None and self.traversal is not None
        if self._stopping:
            return
        self.traversal.tick(now, self.membership.bootstrap)
        own = self.gossip.own.addresses
        addresses = msgspec.structs.replace(own, observed=self.traversal.observed(),
                                            relay=self.traversal.relay_entries())
        if addresses != own:
            self.gossip.update_own(now, addresses=addresses)

    # -- connections -------------------------------------------------------------------------------

    def _maintain_connections(self, now: float) -> None:
        assert self.gossip is not None and self.endpoint is not None
        if self._stopping:
            return
        members = self.gossip.members()
        wanted = self.gossip.desired_connections(now)
        self._prune_connections(wanted, now)
        # A healthy node dials a few peers at once; one whose loop runs late (mesh/failure.py, local
        # health) one at a time: a handshake costs milliseconds of CPU, and a loaded mesh of 50 spent
        # more on redials than on anything else.
        limit = DIALS_IN_FLIGHT if self.detector.health == 0 else 1
        for peer_id in wanted:
            if len(self._dialing) + len(self._relay_dialing) >= limit:
                break
            record = members.get(peer_id)
            if peer_id in self.endpoint.peers or record is None:
                continue
            if record.addresses.relay:
                # Behind a NAT: only its relays reach it first; a punch then finds a direct path.
                _, not_before = self._relay_backoff.get(peer_id, (None, 0.0))
                if peer_id not in self._relay_dialing and now >= not_before:
                    self._relay_dialing[peer_id] = asyncio.create_task(
                        self._dial_relayed(peer_id, record.addresses.relay))
                continue
            _, not_before = self._backoff.get(peer_id, (None, 0.0))
            if peer_id in self._dialing or now < not_before:
                continue
            if not (record.addresses.listen or record.addresses.observed):
                continue
            addrs = [*record.addresses.listen, *record.addresses.observed]
            self._dialing[peer_id] = asyncio.create_task(self._dial_member(peer_id, addrs))
        self._maybe_rebootstrap(now)

    def _prune_connections(self, wanted: set[str], now: float) -> None:
        """Close connections we dialed that our partial view rotated away from, once idle a while.

        Without this, every rotation (a new peer each 30 s) and every indirect probe left one more
        connection that gossip rounds kept from idling out: in a mesh of 50 every member ended up
        connected to all 49 others, and each connection costs timers and packets. The dialer closes
        (the acceptor cannot tell whether the dialer still wants it); one that carries work (a request,
        a lane, a fetch, a relay circuit) stays, and a peer that still wants us dials again.
        """
        assert self.endpoint is not None and self.gossip is not None
        for peer_id in list(self.gossip.connected):  # members only: passive clients' connections are theirs
            conn = self.endpoint.peers.get(peer_id)
            if conn is None or peer_id in wanted or not conn.dialer or conn.carries_work():
                self._unwanted.pop(peer_id, None)
                continue
            since = self._unwanted.setdefault(peer_id, now)
            if now - since >= PRUNE_AFTER_S:
                del self._unwanted[peer_id]
                conn.close("rotated out of the partial view")
        for gone in self._unwanted.keys() - self.gossip.connected:
            del self._unwanted[gone]

    def _maybe_rebootstrap(self, now: float) -> None:
        """Cut off from every peer (say our only relay died): redial the bootstrap members."""
        assert self.endpoint is not None
        backoff, not_before, task = self._rebootstrap
        if self.endpoint.peers or not self.membership.bootstrap or now < not_before:
            return
        if task is not None and not task.done():
            return
        self._rebootstrap = (backoff, now + backoff.next_delay(),
                             asyncio.create_task(self._redial_bootstrap(list(self.membership.bootstrap))))

    async def _redial_bootstrap(self, addrs: list[str]) -> None:
        assert self.endpoint is not None
        for text in addrs:
            try:
                await self.endpoint.connect(parse_addr(text), timeout=DIAL_TIMEOUT_S)
                self._rebootstrap[0].reset()
                return
            except MeshllmError as exc:
                log.debug("bootstrap redial of %s failed: %s", text, exc)

    async def _dial_relayed(self, peer_id: str, relays: list[str]) -> None:
        assert self.traversal is not None
        try:
            for text in relays:
                try:
                    relay_id, addr = parse_relay_entry(text)
                    await self.traversal.dial_via(relay_id, addr, peer_id, timeout=DIAL_TIMEOUT_S)
                    self._relay_backoff.pop(peer_id, None)
                    return
                except MeshllmError as exc:
                    log.debug("relayed dial of %s via %s failed: %s", peer_id[:8], text, exc)
            backoff, _ = self._relay_backoff.get(peer_id, (Backoff(0.2, 2.0, 5.0), 0.0))
            self._relay_backoff[peer_id] = (backoff, time.time() + backoff.next_delay())
        finally:
            self._relay_dialing.pop(peer_id, None)

    async def _dial_member(self, peer_id: str, addrs: list[str]) -> None:
        assert self.endpoint is not None
        try:
            await self.endpoint.connect_node(peer_id, addrs, DIAL_TIMEOUT_S)
            self._backoff.pop(peer_id, None)
        except MeshllmError as exc:
            log.debug("dial %s failed: %s", peer_id[:8], exc)
            backoff, _ = self._backoff.get(peer_id, (Backoff(), 0.0))
            self._backoff[peer_id] = (backoff, time.time() + backoff.next_delay())
        finally:
            self._dialing.pop(peer_id, None)

    async def _bootstrap(self, addrs: list[str]) -> None:
        """Reach at least one member; a refusal is final, silence is retried until the deadline."""
        assert self.endpoint is not None
        deadline = time.monotonic() + BOOTSTRAP_DEADLINE_S
        backoff = Backoff()
        errors: list[str] = []
        while time.monotonic() < deadline:
            for text in addrs:
                try:
                    await self.endpoint.connect(parse_addr(text), timeout=DIAL_TIMEOUT_S)
                    return
                except AdmissionRefused:
                    raise
                except (ConnectError, MeshllmError, OSError) as exc:
                    errors.append(f"{text}: {exc}")
            await asyncio.sleep(min(backoff.next_delay(), max(0.0, deadline - time.monotonic())))
        raise ConnectError(
            f"could not reach any member of {self.membership.mesh_id} at {', '.join(addrs)}",
            hint="check that a member is running and reachable at the invite's addresses "
                 f"(last error: {errors[-1] if errors else 'none'})",
        )

    async def first_view(self) -> None:
        """After :meth:`start`, wait up to :data:`FIRST_VIEW_S` for a member's answer to our first want list,
        so that a node that says it is ready knows the mesh's members and models (``Node.start`` waits for
        it before its ``ready``). Without it a restarted member of a 50-process mesh on a loaded host called
        itself ready while its view held 4 of 49 members for 3 s: requests sent to it could reach only the
        serving members it held. Silence is not an error: anti-entropy fills the view later."""
        assert self.gossip is not None
        if not self.membership.bootstrap:
            return  # the mesh's first member: nobody to hear from
        try:
            async with asyncio.timeout(FIRST_VIEW_S):
                while not self.gossip.answered:
                    await asyncio.sleep(FIRST_VIEW_POLL_S)
        except TimeoutError:
            log.info("no member answered our first want list within %g s; the view fills as gossip runs", FIRST_VIEW_S)

    def _close_peer(self, peer_id: str, reason: str) -> None:
        assert self.endpoint is not None
        conn = self.endpoint.peers.get(peer_id)
        if conn is not None:
            conn.close(reason)

    def _on_peer_event(self, event: PeerEvent) -> None:
        assert self.gossip is not None
        now = time.time()
        conn = self.endpoint.peers.get(event.node_id) if self.endpoint is not None else None
        if conn is not None and conn.passive:
            return  # a passive client (mesh/routes.py): it pulls route tables; gossip never hears of it
        if event.kind is PeerEventKind.CONNECTED:
            entry = self.gossip.state.peers.get(event.node_id)
            if event.node_id in self.admission.revoked_nodes or (entry is not None and entry.status == "revoked"):
                # Admitted before its revocation reached us, registered after (a dial racing the
                # revocation): the close on revocation missed this connection, so close it now.
                self._close_peer(event.node_id, "node revoked by the mesh owner")
                return
            self._on_event("peer_connected", node_id=event.node_id, path=conn.path if conn else "none")
            self.gossip.peer_connected(event.node_id)
            self._handle(self.gossip.greet(event.node_id))
        elif event.kind is PeerEventKind.SUSPECT:
            self._handle(self.gossip.on_detector(self._probe(self.detector.suspect(event.node_id, now)), now))
        elif event.kind is PeerEventKind.ALIVE:
            self._handle(self.gossip.on_detector(self._probe(self.detector.alive(event.node_id)), now))
        elif event.kind is PeerEventKind.UPGRADED:
            self._on_event("peer_path", node_id=event.node_id, path=conn.path if conn else "none")
        elif event.kind is PeerEventKind.CLOSED:
            self.gossip.peer_disconnected(event.node_id)
            self.detector.forget(event.node_id)
            if self.traversal is not None:
                self.traversal.peer_closed(event.node_id)
        self._wake.set()

    # -- messages ----------------------------------------------------------------------------------

    async def _send(self, to: str, message: MeshMessage) -> None:
        """One message on a stream of its own; a peer that does not take it in time gets a strike."""
        assert self.endpoint is not None
        conn = self.endpoint.peers.get(to)
        if conn is None:
            return
        data = encode_message(message)
        if self._in_flight.get(to, 0) + len(data) > SEND_BYTES_IN_FLIGHT:
            log.debug("dropping a gossip message to %s: %d bytes still waiting to leave", to[:8], self._in_flight[to])
            return  # gossip repairs itself; a peer that reads nothing must not grow us
        self._in_flight[to] = self._in_flight.get(to, 0) + len(data)
        stream = None
        try:
            stream = await conn.open_stream(GOSSIP_STREAM)
            await stream.send(msgspec.Raw(data), timeout=SEND_TIMEOUT_S)
            stream.close()
            stream.discard_input()
            await stream.drain(timeout=DRAIN_TIMEOUT_S)
        except NetTimeout as exc:
            if stream is not None:
                if stream.blocked_by_peer:  # it grants no credit; a congested path is nobody's fault
                    conn.strike(f"gossip did not leave in time: {exc}")
                stream.reset()  # frees what it held
        except MeshllmError as exc:
            log.debug("gossip send to %s failed: %s", to[:8], exc)
        finally:
            left = self._in_flight.get(to, 0) - len(data)
            if left > 0:
                self._in_flight[to] = left
            else:
                self._in_flight.pop(to, None)

    def _deliver(self, to: str, message: MeshMessage) -> None:
        """One message to a connected member: a datagram when it fits, else a stream of its own.

        A datagram's loss is what the detector is built for, and the next anti-entropy round repairs a
        lost summary or record. A stream per message (open, frame, close, a task at each end, an ACK for
        each) cost an idle member of a mesh of dozens most of its CPU; a datagram is one packet.
        """
        assert self.endpoint is not None
        conn = self.endpoint.peers.get(to)
        if conn is None:
            return
        data = encode_message(message)
        if len(data) <= DATAGRAM_MESSAGE_MAX and conn.send_datagram(data):
            self.endpoint.traffic.add_sent(GOSSIP_STREAM, len(data))
        elif not isinstance(message, PROBE_MESSAGES):  # a probe that cannot leave now is a lost probe
            spawn(self._tasks, self._send(to, message))

    def _on_datagram(self, conn: Any, data: bytes) -> None:
        """A member's datagram: one mesh message (a probe, or gossip small enough), or a strike."""
        assert self.gossip is not None and self.endpoint is not None
        try:
            message = decode_message(data)
        except DecodeError as exc:
            conn.strike(f"bad gossip datagram: {exc}")
            return
        self.endpoint.traffic.add_received(GOSSIP_STREAM, len(data))
        now = time.time()
        if isinstance(message, PROBE_MESSAGES):
            self._handle(self.gossip.on_detector(self._probe(self.detector.receive(conn.node_id, message, now)), now))
        else:
            self._handle(self.gossip.receive(conn.node_id, message, now))
            self._handle(self.gossip.on_detector(self.detector.alive(conn.node_id), now))  # it spoke: alive
        self._wake.set()

    async def _serve_gossip(self, stream: Any, conn: Any) -> None:
        """One message per stream (the protocol's rule), read within one deadline for the whole frame."""
        assert self.gossip is not None
        if conn.passive:
            stream.fail(ResetCode.NOT_ADMITTED, "a passive client takes no part in gossip")
            return
        try:
            message = await stream.recv(MeshMessage, timeout=RECV_TIMEOUT_S)
        except NetTimeout as exc:
            stream.fail(ResetCode.TIMEOUT, str(exc))
            return
        except StreamClosed as exc:
            if isinstance(exc.__cause__, msgspec.DecodeError | msgspec.ValidationError):
                # a malformed message (a revocation over its 1 KiB cap, ...): reported like a forged one
                self._on_event("record_rejected", source=conn.node_id, error="DecodeError", reason=str(exc))
            raise
        if isinstance(message, PROBE_MESSAGES):
            stream.fail(ResetCode.BAD_FRAME, "probes travel as datagrams")
            conn.strike("a probe on a gossip stream")
            return
        if message is not None:
            now = time.time()
            self._handle(self.gossip.receive(conn.node_id, message, now))
            self._handle(self.gossip.on_detector(self.detector.alive(conn.node_id), now))  # it spoke: alive
        self._wake.set()
