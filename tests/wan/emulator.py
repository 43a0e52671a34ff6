"""A userspace WAN between meshllm nodes on 127.0.0.1: per-link delay, jitter, loss and bandwidth.

This machine has no netem qdisc and tests run without root, so latency is added by a UDP forwarder.
Each emulated node gets two ports: the *real* one its QUIC endpoint binds (``--mesh-port``) and a
*front* one on the emulator, which the node announces (``--announce``) as its address. Peers and
invites therefore name the front, and every datagram between two nodes crosses the emulator once:

    A's socket --> front(B) --[link A->B]--> flow socket --> B's socket
    A's socket <-- front(B) <-[link B->A]--- flow socket <-- B's socket

A node dialing a peer does so from its one socket, whose port tells the emulator who is sending, so
each ordered pair of nodes has its own link whichever of them dialed: a per-link network with one
announced address per node, and nothing in meshllm changed. The forwarding runs in its own process
(:mod:`wan.forwarder`); :class:`WanEmulator` is the handle that starts it and sends it commands.

    with WanEmulator(LinkProfile.rtt(40, loss=0.01)) as wan:
        a = wan.add_node("a")                       # then: meshllm serve ... *a.args
        wan.set_link("a", "b", LinkProfile.rtt(80))
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from wan.forwarder import HOST
from wan.link import LinkProfile, LinkStats

COMMAND_TIMEOUT_S = 10.0


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


class WanError(RuntimeError):
    """The forwarding process refused a command or is gone."""


class WanEmulator:
    """Handle of one forwarding process; ``default`` applies to every ordered pair without its own profile.

    Profiles may change while it runs (:meth:`set_link`, :meth:`set_all`); a link keeps its queue
    and order across the change.
    """

    def __init__(self, default: LinkProfile | None = None, *, seed: int | None = None) -> None:
        self.default = default or LinkProfile()
        self._seed = seed
        self._proc: subprocess.Popen[str] | None = None

    def start(self) -> WanEmulator:
        if self._proc is None:
            tests = str(Path(__file__).resolve().parents[1])
            env = {**os.environ, "PYTHONPATH": os.pathsep.join([tests, os.environ.get("PYTHONPATH", "")])}
            seed = "-" if self._seed is None else str(self._seed)
            self._proc = subprocess.Popen([sys.executable, "-c", "from wan.forwarder import main; main()", seed],
                                          stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
            if self._read() != "ready":
                raise WanError("the forwarding process did not start")
            self.set_all(self.default)
        return self

    def add_node(self, name: str) -> WanNode:
        """Reserve a real port and bind a front for ``name``; pass ``node.args`` to its ``meshllm serve``."""
        ports = self._call({"op": "add_node", "name": name})
        return WanNode(name, ports["real_port"], ports["front_port"])

    def set_link(self, a: str, b: str, profile: LinkProfile, reverse: LinkProfile | None = None) -> None:
        """Profile of the link between ``a`` and ``b`` (``reverse`` for b -> a; default: the same)."""
        self._call({"op": "set_link", "a": a, "b": b, "profile": asdict(profile),
                    "reverse": asdict(reverse or profile)})

    def set_all(self, profile: LinkProfile) -> None:
        """Every link, existing and future, gets ``profile``."""
        self.default = profile
        self._call({"op": "set_all", "profile": asdict(profile)})

    def stats(self) -> dict[tuple[str, str], LinkStats]:
        """Counters per direction that has carried traffic."""
        return {(a, b): LinkStats(**s) for a, b, s in self._call({"op": "stats"})["links"]}

    @property
    def lateness_s(self) -> float:
        """How late the forwarder's timers fire on average (it aims that much early)."""
        return float(self._call({"op": "stats"})["lateness_s"])

    def close(self) -> None:
        """Stop forwarding (closing its input ends the process)."""
        if self._proc is not None:
            proc, self._proc = self._proc, None
            assert proc.stdin is not None
            proc.stdin.close()
            try:
                proc.wait(5.0)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    def __enter__(self) -> WanEmulator:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _call(self, command: dict[str, Any]) -> Any:
        if self._proc is None:
            self.start()
        assert self._proc is not None and self._proc.stdin is not None
        try:
            self._proc.stdin.write(json.dumps(command) + "\n")
            self._proc.stdin.flush()
        except (BrokenPipeError, ValueError):
            raise WanError(f"the forwarding process is gone (exit code {self._proc.poll()})") from None
        return self._read()

    def _read(self) -> Any:
        assert self._proc is not None and self._proc.stdout is not None
        line = self._proc.stdout.readline()  # the forwarder answers every command at once
        if not line:
            raise WanError(f"the forwarding process is gone (exit code {self._proc.poll()})")
        reply = json.loads(line)
        if "error" in reply:
            raise WanError(reply["error"])
        return reply["ok"]
