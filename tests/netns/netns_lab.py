"""A small internet in network namespaces: a public segment, a relay, and hosts behind NAT routers.

Topology (every address exists only inside these namespaces)::

    <p>-inet: bridge br0 = the "public internet" 198.18.0.0/24 (the benchmarking range)
      <p>-relay  198.18.0.10
      <p>-natN   wan 198.18.0.1N  --MASQUERADE-->  lan 10.0.N.1/24
        <p>-hN   10.0.N.2 (default route via 10.0.N.1)

An ``eim`` router is plain MASQUERADE: endpoint-independent mapping (the source port is kept),
address-and-port-dependent filtering (conntrack only lets back replies). A ``symmetric`` router
adds ``--random-fully``: every new destination gets a new random port. Routers drop unsolicited
UDP sent to themselves, so a punch packet that arrives too early is dropped before conntrack
confirms an entry that would clash with the later outgoing mapping (as in most home routers).

Nodes run as ``ip netns exec NS python -m meshllm serve ...``; the test process talks to their
APIs (127.0.0.1 inside each namespace) from a thread that entered the namespace (``setns``).
"""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, TypeVar

import httpx
from nodes import NodeProcess

T = TypeVar("T")
NatKind = Literal["eim", "symmetric"]
RELAY_IP = "198.18.0.10"
MESH_PORT = 9338
CLONE_NEWNET = 0x40000000


def missing_requirements() -> str | None:
    """Why namespace tests cannot run here, or None."""
    if os.geteuid() != 0:
        return "network namespace tests need root"
    for tool in ("ip", "iptables"):
        if shutil.which(tool) is None:
            return f"network namespace tests need `{tool}` (apt-get install iproute2 iptables)"
    return None


def sh(*args: str) -> None:
    subprocess.run(list(args), check=True, capture_output=True, text=True, timeout=20)


def in_netns(ns: str, fn: Callable[[], T]) -> T:
    """Run ``fn`` on a thread that entered network namespace ``ns`` (sockets it opens live there)."""
    result: dict[str, Any] = {}

    def run() -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        with open(f"/var/run/netns/{ns}") as handle:
            if libc.setns(handle.fileno(), CLONE_NEWNET) != 0:
                result["error"] = OSError(ctypes.get_errno(), f"setns into {ns} failed")
                return
        try:
            result["value"] = fn()
        except BaseException as exc:  # re-raised in the caller
            result["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join()
    if "error" in result:
        raise result["error"]
    return result["value"]  # type: ignore[no-any-return]


@dataclass
class Site:
    """A host behind a NAT router (or the relay on the public segment)."""

    ns: str
    ip: str
    public_ip: str
    router: str = ""
    """The NAT router's namespace (none for the relay)."""


@dataclass
class NatLab:
    """Builds the namespaces on :meth:`build`, removes them (and their iptables rules) on :meth:`destroy`."""

    prefix: str
    sites: dict[str, Site] = field(default_factory=dict)
    _namespaces: list[str] = field(default_factory=list)

    def _ns(self, name: str) -> str:
        ns = f"{self.prefix}-{name}"
        sh("ip", "netns", "add", ns)
        self._namespaces.append(ns)
        sh("ip", "-n", ns, "link", "set", "lo", "up")
        return ns

    def build(self, nats: dict[str, NatKind]) -> NatLab:
        inet = self._ns("inet")
        sh("ip", "-n", inet, "link", "add", "br0", "type", "bridge")
        sh("ip", "-n", inet, "link", "set", "br0", "up")
        relay = self._ns("relay")
        self._plug(inet, relay, "p0", f"{RELAY_IP}/24")
        self.sites["relay"] = Site(relay, RELAY_IP, RELAY_IP)
        for n, (name, kind) in enumerate(nats.items(), start=1):
            router, host = self._ns(f"nat{n}"), self._ns(f"h{n}")
            wan = f"198.18.0.{10 + n}"
            self._plug(inet, router, f"p{n}", f"{wan}/24")
            sh("ip", "link", "add", "lan", "netns", router, "type", "veth", "peer", "name", "eth0", "netns", host)
            sh("ip", "-n", router, "addr", "add", f"10.0.{n}.1/24", "dev", "lan")
            sh("ip", "-n", router, "link", "set", "lan", "up")
            sh("ip", "-n", host, "addr", "add", f"10.0.{n}.2/24", "dev", "eth0")
            sh("ip", "-n", host, "link", "set", "eth0", "up")
            sh("ip", "-n", host, "route", "add", "default", "via", f"10.0.{n}.1")
            sh("ip", "netns", "exec", router, "sysctl", "-qw", "net.ipv4.ip_forward=1")
            masquerade = ["iptables", "-t", "nat", "-A", "POSTROUTING", "-o", "wan", "-j", "MASQUERADE"]
            sh("ip", "netns", "exec", router, *masquerade, *(["--random-fully"] if kind == "symmetric" else []))
            sh("ip", "netns", "exec", router, "iptables", "-A", "INPUT", "-i", "wan", "-p", "udp", "-j", "DROP")
            self.sites[name] = Site(host, f"10.0.{n}.2", wan, router)
        return self

    def _plug(self, inet: str, ns: str, port: str, cidr: str) -> None:
        """A veth from ``ns`` (named ``wan``) into the public bridge."""
        sh("ip", "link", "add", "wan", "netns", ns, "type", "veth", "peer", "name", port, "netns", inet)
        sh("ip", "-n", inet, "link", "set", port, "master", "br0", "up")
        sh("ip", "-n", ns, "addr", "add", cidr, "dev", "wan")
        sh("ip", "-n", ns, "link", "set", "wan", "up")

    def block(self, site: str, source_ip: str) -> Callable[[], None]:
        """Make ``site``'s router drop everything from ``source_ip`` (but not the relay's traffic).

        Returns the function that lifts the block. Namespace teardown removes it in any case.
        """
        router = self.sites[site].router
        rule = ["FORWARD", "-s", source_ip, "-j", "DROP"]
        sh("ip", "netns", "exec", router, "iptables", "-I", *rule)
        return lambda: sh("ip", "netns", "exec", router, "iptables", "-D", *rule)

    def destroy(self) -> None:
        for ns in reversed(self._namespaces):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=20)
        self._namespaces.clear()


class NsNode(NodeProcess):
    """A node running inside one of the lab's namespaces, bound to that site's address."""

    def __init__(self, site: Site, home: Path, args: list[str], name: str) -> None:
        self.site = site
        super().__init__(home, ["--mesh-port", str(MESH_PORT), *args], name,
                         prefix=["ip", "netns", "exec", site.ns], mesh_host=site.ip)

    def get(self, path: str, timeout: float = 5.0) -> Any:
        return in_netns(self.site.ns, lambda: httpx.get(self.api + path, timeout=timeout).json())

    def status(self, timeout: float = 5.0) -> dict[str, Any]:
        return self.get("/api/status", timeout)  # type: ignore[no-any-return]

    def peer(self, other: NodeProcess) -> dict[str, Any] | None:
        """``other`` as this node's status lists it (None if absent)."""
        return next((p for p in self.status()["peers"] if p["node_id"] == other.node_id), None)

    def path_to(self, other: NodeProcess) -> str:
        peer = self.peer(other)
        return "absent" if peer is None else f"{peer['path']}" if peer["state"] == "alive" else peer["state"]

    def chat(self, model: str, text: str = "hi", timeout: float = 20.0) -> str:
        """One chat completion through this node's API (the openai client, inside the namespace)."""
        def call() -> str:
            from openai import OpenAI

            client = OpenAI(base_url=self.api + "/v1", api_key="none", timeout=timeout, max_retries=0)
            reply = client.chat.completions.create(
                model=model, messages=[{"role": "user", "content": text}], max_tokens=8, temperature=0)
            return reply.choices[0].message.content or ""
        return in_netns(self.site.ns, call)
