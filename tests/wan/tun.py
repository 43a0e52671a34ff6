"""A WAN at the IP layer: each node in its own network namespace, its packets through a userspace link.

The UDP emulator (:mod:`wan.emulator`) stands in front of nodes' QUIC sockets only; the bulk channel and
the stage lanes are TCP, which a datagram forwarder cannot carry, and a TCP proxy would terminate the
connections (the kernel's congestion control would never see the loss). Here every packet crosses the
link instead: node ``i`` runs in namespace ``<prefix>-i`` whose only interface (besides ``lo``) is a TUN
device ``10.250.0.i/24``; this process holds every TUN's file descriptor, reads each IP packet a node
sends, and writes it to the destination's TUN when :class:`~wan.link.LinkState` says it leaves (or never,
when it is lost). TCP and QUIC in the nodes' kernels and processes then see real delay and loss.

It runs as its own process (as the UDP forwarder does, for the same reason: timing is its whole job) and
needs root (namespaces, TUN devices). Commands on stdin as JSON lines, one JSON line back each:
``{"op": "stats"}``; end of input removes the namespaces and stops it.

    with TunWan(3, LinkProfile.rtt(40, loss=0.01)) as wan:
        wan.ip(1), wan.exec_prefix(1)      # "10.250.0.1", ["ip", "netns", "exec", "<prefix>-1"]
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import json
import os
import random
import shutil
import struct
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

from wan.link import LinkProfile, LinkState

SUBNET = "10.250.0"
TUNSETIFF = 0x400454CA
IFF_TUN, IFF_NO_PI = 0x0001, 0x1000
MTU = 1500
"""An Ethernet path's MTU: TCP segments of 1,448 bytes, QUIC datagrams as on a real link."""


def missing_requirements() -> str | None:
    """Why the IP-level emulator cannot run here, or None."""
    if os.geteuid() != 0:
        return "the IP-level WAN emulator needs root (network namespaces, TUN devices)"
    if shutil.which("ip") is None:
        return "the IP-level WAN emulator needs `ip` (apt-get install iproute2)"
    if not Path("/dev/net/tun").exists():
        return "the IP-level WAN emulator needs /dev/net/tun"
    return None


def _sh(*args: str) -> None:
    subprocess.run(list(args), check=True, capture_output=True, text=True, timeout=20)


def default_congestion() -> str:
    """The kernel's TCP congestion control (what a namespace gets unless told)."""
    return Path("/proc/sys/net/ipv4/tcp_congestion_control").read_text().strip()


def _open_tun(name: str) -> int:
    fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK)
    fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH", name.encode(), IFF_TUN | IFF_NO_PI))
    return fd


class _Links:
    """The TUN devices and one :class:`LinkState` per ordered pair of nodes."""

    def __init__(self, loop: asyncio.AbstractEventLoop, prefix: str, nodes: int, profile: LinkProfile,
                 seed: int | None, congestion: str) -> None:
        self.loop, self.prefix, self.profile = loop, prefix, profile
        self.rng = random.Random(seed)
        self.fds: dict[int, int] = {}
        self.links: dict[tuple[int, int], LinkState] = {}
        self.namespaces: list[str] = []
        for i in range(1, nodes + 1):
            ns, tun = f"{prefix}-{i}", f"{prefix}t{i}"
            _sh("ip", "netns", "add", ns)
            self.namespaces.append(ns)
            _sh("ip", "-n", ns, "link", "set", "lo", "up")
            self.fds[i] = _open_tun(tun)
            _sh("ip", "link", "set", tun, "netns", ns)
            _sh("ip", "-n", ns, "link", "set", tun, "mtu", str(MTU), "up")
            _sh("ip", "-n", ns, "addr", "add", f"{SUBNET}.{i}/24", "dev", tun)
            if congestion:
                _sh("ip", "netns", "exec", ns, "sysctl", "-qw", f"net.ipv4.tcp_congestion_control={congestion}")
            loop.add_reader(self.fds[i], self._read, i)

    def _link(self, a: int, b: int) -> LinkState:
        state = self.links.get((a, b))
        if state is None:
            state = self.links[(a, b)] = LinkState(self.profile, random.Random(self.rng.random()))
        return state

    def _read(self, source: int) -> None:
        while True:
            try:
                packet = os.read(self.fds[source], 65535)
            except (BlockingIOError, InterruptedError):
                return
            if len(packet) < 20 or packet[0] >> 4 != 4 or packet[16:19] != bytes(map(int, SUBNET.split("."))):
                continue  # not IPv4 to a node (IPv6 router solicitations and the like)
            dest = packet[19]
            if dest not in self.fds or dest == source:
                continue
            departure = self._link(source, dest).offer(self.loop.time(), len(packet))
            if departure is not None:
                self.loop.call_at(departure, self._write, dest, packet)

    def _write(self, dest: int, packet: bytes) -> None:
        with contextlib.suppress(OSError):  # a full queue is loss, as on a real path
            os.write(self.fds[dest], packet)

    def close(self) -> None:
        for fd in self.fds.values():
            with contextlib.suppress(OSError, ValueError):
                self.loop.remove_reader(fd)
            os.close(fd)
        for ns in self.namespaces:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=20)


async def _serve(prefix: str, nodes: int, profile: LinkProfile, seed: int | None, congestion: str) -> None:
    loop = asyncio.get_running_loop()
    try:
        links = _Links(loop, prefix, nodes, profile, seed, congestion)
    except (OSError, subprocess.CalledProcessError) as exc:
        for i in range(1, nodes + 1):
            subprocess.run(["ip", "netns", "del", f"{prefix}-{i}"], capture_output=True, timeout=20)
        detail = exc.stderr if isinstance(exc, subprocess.CalledProcessError) else exc
        print(json.dumps({"error": f"could not build the namespaces: {detail}"}), flush=True)
        return
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    print(json.dumps({"ok": "ready"}), flush=True)
    try:
        while line := await reader.readline():
            command = json.loads(line)
            if command.get("op") == "stats":
                reply: dict[str, Any] = {"ok": [[a, b, asdict(s.stats)] for (a, b), s in links.links.items()]}
            else:
                reply = {"error": f"unknown command {command!r}"}
            print(json.dumps(reply), flush=True)
    finally:
        links.close()


def main() -> None:
    """``python -c 'from wan.tun import main; main()' PREFIX NODES PROFILE_JSON SEED|- [CONGESTION]``"""
    prefix, nodes, profile, seed = sys.argv[1], int(sys.argv[2]), LinkProfile(**json.loads(sys.argv[3])), sys.argv[4]
    congestion = sys.argv[5] if len(sys.argv) > 5 else ""
    asyncio.run(_serve(prefix, nodes, profile, None if seed == "-" else int(seed), congestion))


class TunWan:
    """Handle of one IP-level emulator: ``nodes`` namespaces, every link with ``profile`` (each direction).

    ``congestion``: the namespaces' TCP congestion control (``cubic``, ``bbr``...; empty: the kernel's
    default, which a new namespace inherits). It decides what random loss costs: BBR paces at the
    bandwidth it measures and shrugs random loss off, Reno and CUBIC shrink their window at each loss
    event. A namespace may only pick one of ``net.ipv4.tcp_allowed_congestion_control``."""

    def __init__(self, nodes: int, profile: LinkProfile, *, seed: int | None = None, prefix: str | None = None,
                 congestion: str = "") -> None:
        self.nodes, self.profile, self.seed, self.congestion = nodes, profile, seed, congestion
        self.prefix = prefix or f"mw{os.getpid() % 100000}"
        self._proc: subprocess.Popen[str] | None = None

    def ip(self, node: int) -> str:
        return f"{SUBNET}.{node}"

    def ns(self, node: int) -> str:
        return f"{self.prefix}-{node}"

    def exec_prefix(self, node: int) -> list[str]:
        """What runs a command inside node ``node``'s namespace."""
        return ["ip", "netns", "exec", self.ns(node)]

    def start(self) -> TunWan:
        tests = str(Path(__file__).resolve().parents[1])
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([tests, os.environ.get("PYTHONPATH", "")])}
        self._proc = subprocess.Popen(
            [sys.executable, "-c", "from wan.tun import main; main()", self.prefix, str(self.nodes),
             json.dumps(asdict(self.profile)), "-" if self.seed is None else str(self.seed), self.congestion],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        self._read()
        return self

    def stats(self) -> dict[tuple[int, int], dict[str, int]]:
        """Counters per direction that has carried packets (sent, dropped, bytes)."""
        assert self._proc is not None and self._proc.stdin is not None
        self._proc.stdin.write(json.dumps({"op": "stats"}) + "\n")
        self._proc.stdin.flush()
        return {(a, b): s for a, b, s in self._read()}

    def _read(self) -> Any:
        assert self._proc is not None and self._proc.stdout is not None
        line = self._proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the IP-level emulator is gone (exit code {self._proc.poll()})")
        reply = json.loads(line)
        if "error" in reply:
            raise RuntimeError(reply["error"])
        return reply["ok"]

    def close(self) -> None:
        if self._proc is not None:
            proc, self._proc = self._proc, None
            assert proc.stdin is not None
            proc.stdin.close()  # the emulator removes its namespaces and exits
            try:
                proc.wait(20.0)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    def __enter__(self) -> TunWan:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()
