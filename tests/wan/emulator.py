"""A userspace WAN between meshllm nodes on 127.0.0.1: per-link delay, jitter, loss and bandwidth.

This machine has no netem qdisc and tests run without root, so latency is added by a UDP forwarder.
Each emulated node gets two ports: the *real* one its QUIC endpoint binds (``--mesh-port``) and a
*front* one on the emulator, which the node announces (``--announce``) as its address. Peers and
invites therefore name the front, and every datagram between two nodes crosses the emulator once:

    A's socket --> front(B) --[link A->B]--> flow socket --> B's socket
    A's socket <-- front(B) <-[link B->A]--- flow socket <-- B's socket

For each source that writes to a front the emulator opens a *flow* socket connected to the node
behind it (a NAT-like mapping), so the node's replies come back to that flow and are returned
through the same front. The source's port names the sending node, so each ordered pair of nodes has
its own :class:`~wan.link.LinkState` whichever of them dialed: a per-link network with one announced
address per node, and nothing in meshllm changed. Datagrams from ports the emulator does not know
(a CLI, a stranger) travel on the destination's default link.

The forwarder runs its own event loop in a daemon thread, so it keeps time while the test's thread
waits on HTTP; its cost is in docs/benchmarks.md ("WAN emulator").
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import selectors
import socket
import threading
from collections.abc import Iterator
from dataclasses import dataclass

from wan.link import LinkProfile, LinkState, LinkStats

HOST = "127.0.0.1"
UNKNOWN = "?"
"""Name of sources that are no emulated node."""
SOCKET_BUFFER = 4 * 1024 * 1024
"""Kernel buffers per socket: a prompt chunk's burst must not overflow them (that would be extra loss)."""
MAX_DATAGRAM = 65535
LATENESS_MAX_S = 0.001
"""Largest lateness sample that counts (a stalled loop must not make the datagrams after it early)."""


@dataclass(frozen=True)
class WanNode:
    """An emulated node: where it binds and what it announces."""

    name: str
    real_port: int
    """Port the node's QUIC endpoint binds (``--mesh-port``)."""
    front_port: int
    """Port on the emulator that stands for the node (``--announce``)."""

    @property
    def front_addr(self) -> str:
        return f"{HOST}:{self.front_port}"

    @property
    def args(self) -> list[str]:
        """``meshllm serve``/``join`` options that put the node behind the emulator."""
        return ["--mesh-host", HOST, "--mesh-port", str(self.real_port), "--announce", self.front_addr]


class _Flow:
    """The mapping of one source to one node: a socket connected to the node, and the source's address."""

    def __init__(self, node: WanNode, source: tuple[str, int], source_name: str) -> None:
        self.node = node
        self.source = source
        self.source_name = source_name
        self.sock = _udp_socket()
        self.sock.connect((HOST, node.real_port))


class WanEmulator:
    """Forwards UDP between registered nodes through emulated links; start it before the nodes.

    ``default`` applies to every ordered pair without its own profile. Profiles may change while it
    runs (:meth:`set_link`); a link keeps its queue and order across the change.
    """

    def __init__(self, default: LinkProfile | None = None, *, seed: int | None = None) -> None:
        self.default = default or LinkProfile()
        self._rng = random.Random(seed)
        self._profiles: dict[tuple[str, str], LinkProfile] = {}
        self._links: dict[tuple[str, str], LinkState] = {}
        self._nodes: dict[str, WanNode] = {}
        self._fronts: dict[str, socket.socket] = {}
        self._by_port: dict[int, str] = {}
        self._flows: dict[tuple[str, tuple[str, int]], _Flow] = {}
        # select() sleeps to the microsecond; epoll (asyncio's default) rounds every wait up to a millisecond
        self._loop = asyncio.SelectorEventLoop(selectors.SelectSelector())
        self.lateness_s = 0.0
        """Average of how late timers fire (wake-up latency); sends are aimed that much early."""
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    # -- setup -------------------------------------------------------------------------------------

    def add_node(self, name: str) -> WanNode:
        """Reserve a real port and bind a front for ``name``; pass ``node.args`` to its ``meshllm serve``."""
        if name in self._nodes or name == UNKNOWN:
            raise ValueError(f"node name {name!r} is taken")
        front = _udp_socket()
        front.bind((HOST, 0))
        node = WanNode(name, _free_udp_port(), front.getsockname()[1])
        with self._lock:
            self._nodes[name] = node
            self._fronts[name] = front
            self._by_port[node.real_port] = name
        self._call(self._loop.add_reader, front.fileno(), self._from_source, node, front)
        return node

    def set_link(self, a: str, b: str, profile: LinkProfile, reverse: LinkProfile | None = None) -> None:
        """Profile of the link between ``a`` and ``b`` (``reverse`` for b -> a; default: the same)."""
        for pair, p in (((a, b), profile), ((b, a), reverse or profile)):
            with self._lock:
                self._profiles[pair] = p
                if pair in self._links:
                    self._links[pair].profile = p

    def set_all(self, profile: LinkProfile) -> None:
        """Every link, existing and future, gets ``profile``."""
        with self._lock:
            self.default = profile
            self._profiles.clear()
            for state in self._links.values():
                state.profile = profile

    def link(self, a: str, b: str) -> LinkState:
        """The state of direction ``a -> b`` (created on first use)."""
        with self._lock:
            state = self._links.get((a, b))
            if state is None:
                profile = self._profiles.get((a, b), self.default)
                state = self._links[(a, b)] = LinkState(profile, random.Random(self._rng.random()))
            return state

    def stats(self) -> dict[tuple[str, str], LinkStats]:
        """Counters per direction that has carried traffic."""
        with self._lock:
            return {pair: LinkStats(**vars(state.stats)) for pair, state in self._links.items()}

    # -- lifecycle -----------------------------------------------------------------------------------

    def start(self) -> WanEmulator:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop.run_forever, name="wan-emulator", daemon=True)
            self._thread.start()
        return self

    def close(self) -> None:
        """Stop forwarding and close every socket."""
        if self._thread is not None:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(5.0)
            self._thread = None
        for sock in [*self._fronts.values(), *(f.sock for f in self._flows.values())]:
            with contextlib.suppress(OSError):
                self._loop.remove_reader(sock.fileno())
            sock.close()
        self._loop.close()

    def __enter__(self) -> WanEmulator:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- forwarding (loop thread) ---------------------------------------------------------------------

    def _call(self, fn: object, *args: object) -> None:
        if self._thread is None:
            fn(*args)  # type: ignore[operator]
        else:
            self._loop.call_soon_threadsafe(fn, *args)  # type: ignore[arg-type]

    def _from_source(self, node: WanNode, front: socket.socket) -> None:
        """Datagrams a peer sent to ``node``'s front: through link source -> node, out of the flow socket."""
        for data, source in _drain(front):
            flow = self._flows.get((node.name, source))
            if flow is None:
                flow = self._open_flow(node, source)
            self._schedule(self.link(flow.source_name, node.name), data, flow.sock.send, data)

    def _open_flow(self, node: WanNode, source: tuple[str, int]) -> _Flow:
        name = self._by_port.get(source[1], UNKNOWN) if source[0] == HOST else UNKNOWN
        flow = self._flows[(node.name, source)] = _Flow(node, source, name)
        self._loop.add_reader(flow.sock.fileno(), self._from_node, flow)
        return flow

    def _from_node(self, flow: _Flow) -> None:
        """The node's replies on a flow: through link node -> source, out of the node's front."""
        front = self._fronts[flow.node.name]
        for data, _ in _drain(flow.sock):
            self._schedule(self.link(flow.node.name, flow.source_name), data, front.sendto, data, flow.source)

    def _schedule(self, link: LinkState, data: bytes, send: object, *args: object) -> None:
        now = self._loop.time()
        departure = link.offer(now, len(data))
        if departure is None:
            return
        if departure - self.lateness_s <= now:
            _send(send, *args)
        else:
            self._loop.call_at(departure - self.lateness_s, self._send_late, departure, send, *args)

    def _send_late(self, departure: float, send: object, *args: object) -> None:
        late = self._loop.time() - (departure - self.lateness_s)
        self.lateness_s = 0.95 * self.lateness_s + 0.05 * min(max(late, 0.0), LATENESS_MAX_S)
        _send(send, *args)


def _send(send: object, *args: object) -> None:
    """Send one datagram; a full buffer or a vanished node is just loss, as on a real path."""
    with contextlib.suppress(OSError):
        send(*args)  # type: ignore[operator]


def _drain(sock: socket.socket) -> Iterator[tuple[bytes, tuple[str, int]]]:
    while True:
        try:
            data, addr = sock.recvfrom(MAX_DATAGRAM)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:  # ICMP port unreachable from a node that went away
            continue
        yield data, addr


def _udp_socket() -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.setblocking(False)
    for opt in (socket.SO_RCVBUF, socket.SO_SNDBUF):
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, opt, SOCKET_BUFFER)
    return sock


def _free_udp_port() -> int:
    """A UDP port free right now on 127.0.0.1 (the node binds it moments later)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.bind((HOST, 0))
        return int(probe.getsockname()[1])
