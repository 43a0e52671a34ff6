"""The forwarding process of the WAN emulator: sockets, timers and the links, on one event loop.

It runs alone in its own process (started by :class:`~wan.emulator.WanEmulator`) because timing is
its whole job: in a process that also runs a test or a benchmark, any Python thread holding the GIL
delays forwarding by up to the interpreter's 5 ms switch interval (measured: p90 round trip 0.07 ms
alone, 60 ms beside one busy thread).

Each emulated node has a *front* socket that stands for it (peers dial it) and, per source that
writes to the front, a *flow* socket connected to the node's real port, so the node's replies come
back on the flow and leave through the front to that source. The source's port names the sending
node, so every ordered pair of nodes has its own :class:`~wan.link.LinkState` whichever of them dialed.

Commands arrive as JSON lines on stdin and each gets one JSON line on stdout:
``{"op": "add_node", "name"}``, ``{"op": "set_link", "a", "b", "profile", "reverse"}``,
``{"op": "set_all", "profile"}``, ``{"op": "stats"}``; end of input stops it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import selectors
import socket
import sys
from collections.abc import Callable, Iterator
from dataclasses import asdict
from typing import Any

from wan.link import LinkProfile, LinkState

HOST = "127.0.0.1"
UNKNOWN = "?"
"""Name of sources that are no emulated node (a CLI, a stranger): they use the destination's default link."""
SOCKET_BUFFER = 4 * 1024 * 1024
"""Kernel buffers per socket (capped by the system's limit): a prompt chunk's burst must not become loss."""
MAX_DATAGRAM = 65535
LATENESS_MAX_S = 0.001
"""Largest lateness sample that counts (a stalled loop must not make the datagrams after it early)."""


class _Flow:
    """The mapping of one source to one node: a socket connected to the node, and the source's address."""

    def __init__(self, node: str, real_port: int, source: tuple[str, int], source_name: str) -> None:
        self.node = node
        self.source = source
        self.source_name = source_name
        self.sock = udp_socket()
        self.sock.connect((HOST, real_port))


class Forwarder:
    """Fronts, flows and links; every method runs on ``loop``'s thread."""

    def __init__(self, loop: asyncio.AbstractEventLoop, seed: int | None = None) -> None:
        self.loop = loop
        self.default = LinkProfile()
        self.lateness_s = 0.0
        """Average of how late timers fire (wake-up latency); sends are aimed that much early."""
        self._rng = random.Random(seed)
        self._profiles: dict[tuple[str, str], LinkProfile] = {}
        self._links: dict[tuple[str, str], LinkState] = {}
        self._real: dict[str, int] = {}
        self._fronts: dict[str, socket.socket] = {}
        self._by_port: dict[int, str] = {}
        self._flows: dict[tuple[str, tuple[str, int]], _Flow] = {}

    # -- commands ------------------------------------------------------------------------------

    def add_node(self, name: str) -> dict[str, int]:
        if name in self._real or name == UNKNOWN:
            raise ValueError(f"node name {name!r} is taken")
        front = udp_socket()
        front.bind((HOST, 0))
        real = free_udp_port()
        self._real[name], self._fronts[name], self._by_port[real] = real, front, name
        self.loop.add_reader(front.fileno(), self._from_source, name, front)
        return {"real_port": real, "front_port": front.getsockname()[1]}

    def set_link(self, a: str, b: str, profile: LinkProfile, reverse: LinkProfile) -> None:
        for pair, p in (((a, b), profile), ((b, a), reverse)):
            self._profiles[pair] = p
            if pair in self._links:
                self._links[pair].profile = p

    def set_all(self, profile: LinkProfile) -> None:
        self.default = profile
        self._profiles.clear()
        for state in self._links.values():
            state.profile = profile

    def stats(self) -> dict[str, Any]:
        return {"links": [[a, b, asdict(state.stats)] for (a, b), state in self._links.items()],
                "lateness_s": self.lateness_s}

    def close(self) -> None:
        for sock in [*self._fronts.values(), *(f.sock for f in self._flows.values())]:
            with contextlib.suppress(OSError, ValueError):
                self.loop.remove_reader(sock.fileno())
            sock.close()

    # -- forwarding ------------------------------------------------------------------------------

    def link(self, a: str, b: str) -> LinkState:
        state = self._links.get((a, b))
        if state is None:
            profile = self._profiles.get((a, b), self.default)
            state = self._links[(a, b)] = LinkState(profile, random.Random(self._rng.random()))
        return state

    def _from_source(self, node: str, front: socket.socket) -> None:
        """Datagrams a peer sent to ``node``'s front: through link source -> node, out of the flow socket."""
        for data, source in drain(front):
            flow = self._flows.get((node, source)) or self._open_flow(node, source)
            self._schedule(self.link(flow.source_name, node), data, flow.sock.send, data)

    def _open_flow(self, node: str, source: tuple[str, int]) -> _Flow:
        name = self._by_port.get(source[1], UNKNOWN) if source[0] == HOST else UNKNOWN
        flow = self._flows[(node, source)] = _Flow(node, self._real[node], source, name)
        self.loop.add_reader(flow.sock.fileno(), self._from_node, flow)
        return flow

    def _from_node(self, flow: _Flow) -> None:
        """The node's replies on a flow: through link node -> source, out of the node's front."""
        front = self._fronts[flow.node]
        for data, _ in drain(flow.sock):
            self._schedule(self.link(flow.node, flow.source_name), data, front.sendto, data, flow.source)

    def _schedule(self, link: LinkState, data: bytes, send: Callable[..., object], *args: object) -> None:
        now = self.loop.time()
        departure = link.offer(now, len(data))
        if departure is None:
            return
        if departure - self.lateness_s <= now:
            send_quietly(send, *args)
        else:
            self.loop.call_at(departure - self.lateness_s, self._send_late, departure, send, *args)

    def _send_late(self, departure: float, send: Callable[..., object], *args: object) -> None:
        late = self.loop.time() - (departure - self.lateness_s)
        self.lateness_s = 0.95 * self.lateness_s + 0.05 * min(max(late, 0.0), LATENESS_MAX_S)
        send_quietly(send, *args)


def send_quietly(send: Callable[..., object], *args: object) -> None:
    """Send one datagram; a full buffer or a vanished node is just loss, as on a real path."""
    with contextlib.suppress(OSError):
        send(*args)


def drain(sock: socket.socket) -> Iterator[tuple[bytes, tuple[str, int]]]:
    while True:
        try:
            data, addr = sock.recvfrom(MAX_DATAGRAM)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:  # ICMP port unreachable from a node that went away
            continue
        yield data, addr


def udp_socket() -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.setblocking(False)
    for opt in (socket.SO_RCVBUF, socket.SO_SNDBUF):
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, opt, SOCKET_BUFFER)
    return sock


def free_udp_port() -> int:
    """A UDP port free right now on 127.0.0.1 (the node binds it moments later)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.bind((HOST, 0))
        return int(probe.getsockname()[1])


def _command(fwd: Forwarder, line: str) -> Any:
    cmd = json.loads(line)
    op = cmd.get("op")
    if op == "add_node":
        return fwd.add_node(cmd["name"])
    if op == "set_link":
        fwd.set_link(cmd["a"], cmd["b"], LinkProfile(**cmd["profile"]), LinkProfile(**cmd["reverse"]))
        return None
    if op == "set_all":
        fwd.set_all(LinkProfile(**cmd["profile"]))
        return None
    if op == "stats":
        return fwd.stats()
    raise ValueError(f"unknown command {op!r}")


def main() -> None:
    """Serve commands until stdin ends; ``argv[1]`` is the random seed ("-": none)."""
    seed = int(sys.argv[1]) if len(sys.argv) > 1 and sys.argv[1] != "-" else None
    # select() sleeps to the microsecond; epoll (asyncio's default) rounds every wait up to a millisecond
    loop = asyncio.SelectorEventLoop(selectors.SelectSelector())
    fwd = Forwarder(loop, seed)
    stdin = sys.stdin.buffer

    def on_command() -> None:
        line = stdin.readline()
        if not line:
            loop.stop()
            return
        try:
            reply = {"ok": _command(fwd, line.decode())}
        except (ValueError, KeyError, TypeError) as exc:
            reply = {"error": f"{type(exc).__name__}: {exc}"}
        sys.stdout.write(json.dumps(reply) + "\n")
        sys.stdout.flush()

    loop.add_reader(stdin.fileno(), on_command)
    sys.stdout.write(json.dumps({"ok": "ready"}) + "\n")
    sys.stdout.flush()
    try:
        loop.run_forever()
    finally:
        fwd.close()
        loop.close()
