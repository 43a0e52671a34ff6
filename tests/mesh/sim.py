"""A simulated network that drives the real gossip and failure-detection cores.

No sockets and no sleeping: a discrete-event loop with a simulated clock, per-link latency and
loss. Each :class:`SimNode` is wired exactly as the node driver will be (see the glue in
:meth:`SimNet._dispatch`), so tests and ``bench/gossip_sim.py`` exercise the production code paths;
messages are encoded to count their bytes, but handed over as objects (decoding is tested apart).
"""

from __future__ import annotations

import heapq
import itertools
import random
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field

from nacl.signing import SigningKey

from meshllm.errors import WrongMesh
from meshllm.identity.ids import node_id as node_id_of
from meshllm.mesh import view
from meshllm.mesh.failure import Failed, FailureConfig, FailureDetector, Probe, Recovered, Suspected
from meshllm.mesh.gossip import Gossip, GossipConfig, Rejected, Send
from meshllm.mesh.messages import Ack, MeshMessage, Ping, PingReq, encode_message
from meshllm.mesh.records import PeerRecord, RecordVerifier, SignatureCache

MESH = "simmesh"
PROBES = (Ping, Ack, PingReq)


def proof_for(node: str) -> bytes:
    """The stub membership proof the simulated mesh accepts."""
    return b"member:" + node.encode()


def check_member(node: str, proof: bytes, now: float) -> None:
    if proof != proof_for(node):
        raise WrongMesh(f"{node[:8]} presents no valid membership proof")


def check_trust(node: str, cert: bytes | None, now: float) -> None:
    """Trust policy ``off``."""


def make_key(seed: int) -> SigningKey:
    """A deterministic node key."""
    return SigningKey(random.Random(seed).randbytes(32))


def make_record(key: SigningKey, seq: int = 1, **fields: object) -> PeerRecord:
    """A valid record of ``key``'s node in the simulated mesh."""
    nid = node_id_of(bytes(key.verify_key))
    return PeerRecord(node_id=nid, mesh_id=MESH, seq=seq, membership_proof=proof_for(nid), **fields)  # type: ignore[arg-type]


def make_verifier(cache: SignatureCache | None = None) -> RecordVerifier:
    return RecordVerifier(MESH, check_member, check_trust, cache)


@dataclass
class SimNode:
    """One node: its cores plus what the simulation observes about it."""

    key: SigningKey
    gossip: Gossip
    fd: FailureDetector
    alive: bool = True
    desired: set[str] = field(default_factory=set)
    rejected: list[Rejected] = field(default_factory=list)
    id: str = ""

    def __post_init__(self) -> None:
        self.id = self.gossip.node_id


class SimNet:
    """Discrete-event simulation of ``n`` nodes; node 0 is everyone's bootstrap peer."""

    def __init__(
        self,
        n: int,
        seed: int = 1,
        latency_ms: tuple[float, float] = (2.0, 40.0),
        loss: float = 0.0,
        gossip_config: GossipConfig | None = None,
        failure_config: FailureConfig | None = None,
        preseed: bool = False,
    ) -> None:
        self.now = 0.0
        self.rng = random.Random(seed)
        self.latency_ms, self.loss = latency_ms, loss
        self._queue: list[tuple[float, int, str, Callable[[], None]]] = []
        self._counter = itertools.count()
        self._scheduled: dict[str, float] = {}
        self._next_refresh: dict[str, float] = {}
        self._link_latency: dict[tuple[str, str], float] = {}
        self.bytes_sent: dict[str, int] = defaultdict(int)
        self.bytes_by_kind: dict[str, int] = defaultdict(int)
        self.messages = 0
        self.observers: list[Callable[[SimNode, object], None]] = []
        cache = SignatureCache(size=4 * n + 1024)
        self.nodes: dict[str, SimNode] = {}
        # Nodes that start converged have been in the mesh a while: their records already promise
        # the refresh period of a mesh this size.
        refresh = (gossip_config or GossipConfig()).refresh_for(n) if preseed else 30.0
        for i in range(n):
            key = make_key(seed * 1_000_003 + i)
            record = make_record(key, name=f"n{i}", refresh=max(30.0, refresh))
            gossip = Gossip(key, record, make_verifier(cache), random.Random(seed * 7919 + i), 0.0, gossip_config)
            fd = FailureDetector(random.Random(seed * 104729 + i), 0.0, failure_config)
            self.nodes[record.node_id] = SimNode(key, gossip, fd)
        self.ids = list(self.nodes)
        self._greet = True
        if preseed:
            self._preseed()
        else:
            for nid in self.ids[1:]:
                self._connect(nid, self.ids[0])
        for nid in self.ids:
            self._schedule(nid, self.rng.uniform(0.0, 0.5))

    # --- driving ---

    def run_until(self, t: float, stop: Callable[[], bool] | None = None) -> None:
        """Process events up to simulated time ``t`` (or until ``stop()`` turns true)."""
        while self._queue and self._queue[0][0] <= t:
            when, _, _, action = heapq.heappop(self._queue)
            self.now = when
            action()
            if stop is not None and stop():
                return
        self.now = max(self.now, t)

    def kill(self, nid: str) -> None:
        """Crash a node: it stops answering, with no goodbye."""
        self.nodes[nid].alive = False

    def live(self) -> list[SimNode]:
        return [n for n in self.nodes.values() if n.alive]

    def act(self, nid: str, outputs: list) -> None:
        """Feed outputs a test produced by calling a node's core directly."""
        self._dispatch(self.nodes[nid], outputs)

    # --- internals ---

    def _preseed(self) -> None:
        """Start converged, connections open: every node holds every record (one table shared).

        Each node's table is the full table less itself, which shares all but one path with it, so
        10,000 nodes start in the memory of about one table, not 10,000.
        """
        full = view.Table.of({
            nid: view.PeerEntry(node.gossip.own, node.gossip.own_raw, "alive", 0.0, 0.0)
            for nid, node in self.nodes.items()
        })
        cfg = next(iter(self.nodes.values())).gossip.config
        first = min(view.deadline(e, cfg.stale_after, cfg.forget_after) for e in full.values())
        for nid, node in self.nodes.items():
            node.gossip.adopt(view.ViewState(nid, full.remove(nid)), first)
        self._greet = False  # the connections below are already established: no greeting on them
        for nid in self.ids:
            self._refresh_connections(nid)
        self._greet = True

    def _schedule(self, nid: str, when: float) -> None:
        if self._scheduled.get(nid, float("inf")) <= when:
            return
        self._scheduled[nid] = when
        heapq.heappush(self._queue, (when, next(self._counter), nid, lambda: self._tick(nid, when)))

    def _tick(self, nid: str, when: float) -> None:
        if self._scheduled.get(nid) != when:
            return
        del self._scheduled[nid]
        node = self.nodes[nid]
        if not node.alive:
            return
        if self.now >= self._next_refresh.get(nid, 0.0):
            self._next_refresh[nid] = self.now + 1.0
            self._refresh_connections(nid)
        out = node.gossip.tick(self.now)
        out += node.fd.tick(self.now, node.gossip.watched())
        self._dispatch(node, out)
        self._reschedule(node)

    def _reschedule(self, node: SimNode) -> None:
        self._schedule(node.id, max(self.now + 0.01, min(node.gossip.next_timer(), node.fd.next_timer())))

    def _refresh_connections(self, nid: str) -> None:
        node = self.nodes[nid]
        new = node.gossip.desired_connections(self.now)
        for peer in sorted(node.gossip.connected - new):
            other = self.nodes[peer]
            if nid not in other.desired or not other.alive:
                self._disconnect(nid, peer)
        for peer in new - node.desired:
            if self.nodes[peer].alive:
                self._connect(nid, peer)
        node.desired = new

    def _connect(self, a: str, b: str) -> None:
        """A new connection: both ends note it and greet (as the node driver does)."""
        self.nodes[a].gossip.peer_connected(b)
        self.nodes[b].gossip.peer_connected(a)
        if self._greet:
            self._dispatch(self.nodes[a], self.nodes[a].gossip.greet(b))
            self._dispatch(self.nodes[b], self.nodes[b].gossip.greet(a))

    def _disconnect(self, a: str, b: str) -> None:
        self.nodes[a].gossip.peer_disconnected(b)
        self.nodes[b].gossip.peer_disconnected(a)

    def _send(self, src: str, dst: str, message: MeshMessage) -> None:
        size = len(encode_message(message))
        self.bytes_sent[src] += size
        self.bytes_by_kind[type(message).__name__] += size
        self.messages += 1
        if self.rng.random() < self.loss:
            return
        link = (src, dst) if src < dst else (dst, src)
        one_way = self._link_latency.get(link)
        if one_way is None:
            one_way = self._link_latency[link] = self.rng.uniform(*self.latency_ms) / 2000.0
        when = self.now + one_way
        heapq.heappush(self._queue, (when, next(self._counter), dst, lambda: self._deliver(src, dst, message)))

    def _deliver(self, src: str, dst: str, message: MeshMessage) -> None:
        node = self.nodes[dst]
        if not node.alive:
            return
        if src not in node.gossip.connected and self.nodes[src].alive:
            self._connect(src, dst)  # an inbound message implies the transport accepted a connection
        out: list = node.fd.receive(src, message, self.now) + node.gossip.receive(src, message, self.now)
        self._dispatch(node, out)
        if not isinstance(message, PROBES):
            # A probe never brings a timer forward (an ack ends one; a relayed ping's deadline is
            # swept by the next tick), so only gossip messages reschedule: most messages are probes.
            self._reschedule(node)

    def _dispatch(self, node: SimNode, outputs: list) -> None:
        """The node-driver glue: route each output of the cores to the network or the other core."""
        for out in outputs:
            if isinstance(out, Send | Probe):
                self._send(node.id, out.to, out.message)
            elif isinstance(out, Suspected | Recovered | Failed):
                self._dispatch(node, node.gossip.on_detector([out], self.now))
            elif isinstance(out, Rejected):
                node.rejected.append(out)
            else:
                if isinstance(out, view.PeerRemoved):
                    node.fd.forget(out.node_id)
                for observer in self.observers:
                    observer(node, out)
