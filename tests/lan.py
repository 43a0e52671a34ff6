"""A two-host LAN in network namespaces, for tests of LAN discovery (mDNS) that must not touch the host's network."""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager

import pytest


def _sh(*args: str) -> None:
    subprocess.run(args, check=True, capture_output=True, timeout=10)


@contextmanager
def two_host_lan(tag: str, subnet: str) -> Iterator[tuple[str, str, str, str]]:
    """Namespaces A (``subnet``.1) and B (``subnet``.2) on a bridge inside a third (hub) namespace,
    so no multicast reaches the host's interfaces. Skips the test when namespaces cannot be built."""
    if shutil.which("ip") is None:
        pytest.skip("needs the `ip` tool (iproute2)")
    if os.geteuid() != 0:
        pytest.skip("needs root to create network namespaces")
    hub, ns_a, ns_b = f"{tag}h", f"{tag}a", f"{tag}b"
    try:
        for ns in (hub, ns_a, ns_b):
            _sh("ip", "netns", "add", ns)
        _sh("ip", "-n", hub, "link", "add", "br0", "type", "bridge")
        _sh("ip", "-n", hub, "link", "set", "br0", "up")
        for port, ns, ip in (("pa", ns_a, f"{subnet}.1"), ("pb", ns_b, f"{subnet}.2")):
            _sh("ip", "-n", hub, "link", "add", port, "type", "veth", "peer", "name", "eth0", "netns", ns)
            _sh("ip", "-n", hub, "link", "set", port, "master", "br0")
            _sh("ip", "-n", hub, "link", "set", port, "up")
            _sh("ip", "-n", ns, "addr", "add", f"{ip}/24", "dev", "eth0")
            _sh("ip", "-n", ns, "link", "set", "eth0", "up")
            _sh("ip", "-n", ns, "link", "set", "lo", "up")
            _sh("ip", "-n", ns, "route", "add", "224.0.0.0/4", "dev", "eth0")
    except subprocess.CalledProcessError as exc:
        for ns in (hub, ns_a, ns_b):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        pytest.skip(f"cannot build network namespaces here: {exc.stderr.decode().strip()}")
    try:
        yield ns_a, f"{subnet}.1", ns_b, f"{subnet}.2"
    finally:
        for ns in (ns_a, ns_b, hub):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
