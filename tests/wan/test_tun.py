"""The IP-level emulator: kernel TCP between two namespaces crosses the link's delay and loss intact.

Real namespaces, TUN devices and sockets (needs root). The client and server run inside the
namespaces through ``ip netns exec``; timing bounds are one-sided (load only adds delay).
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from wan import LinkProfile
from wan.tun import TunWan, missing_requirements

pytestmark = [pytest.mark.netns, pytest.mark.skipif(missing_requirements() is not None,
                                                    reason=missing_requirements() or "")]

SERVER = """
import hashlib, socket, sys
s = socket.socket(); s.bind((sys.argv[1], 7100)); s.listen()
print("listening", flush=True)
c, _ = s.accept(); digest = hashlib.sha256(); n = 0
while (d := c.recv(1 << 16)):
    digest.update(d); n += len(d)
print(n, digest.hexdigest(), flush=True)
"""
CLIENT = """
import hashlib, os, socket, sys, time
data = os.urandom(int(sys.argv[2]))
t = time.perf_counter(); c = socket.create_connection((sys.argv[1], 7100), timeout=20)
print(time.perf_counter() - t, hashlib.sha256(data).hexdigest(), flush=True)
c.sendall(data); c.close()
"""


def send(wan: TunWan, size: int) -> tuple[float, str, int, str]:
    """``size`` random bytes over TCP from node 1 to node 2: connect seconds, sent digest, received bytes and digest."""
    server = subprocess.Popen([*wan.exec_prefix(2), sys.executable, "-c", SERVER, wan.ip(2)],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert server.stdout is not None and server.stdout.readline().strip() == "listening"
        client = subprocess.run([*wan.exec_prefix(1), sys.executable, "-c", CLIENT, wan.ip(2), str(size)],
                                capture_output=True, text=True, timeout=60, check=True)
        connect_s, sent = client.stdout.split()
        got, received = server.stdout.readline().split()
        server.wait(10)
    finally:
        server.kill()
    return float(connect_s), sent, int(got), received


def test_tcp_crosses_the_delay_and_arrives_whole() -> None:
    with TunWan(2, LinkProfile.rtt(40), seed=1) as wan:
        connect_s, sent, got, received = send(wan, 1 << 20)
        stats = wan.stats()
    assert connect_s >= 0.039  # the SYN and SYN-ACK crossed the link: one round trip
    assert got == 1 << 20 and received == sent
    assert stats[(1, 2)]["sent"] > 700 and stats[(2, 1)]["sent"] > 0  # 1 MiB in ~1,500-byte packets


def test_tcp_recovers_every_lost_packet() -> None:
    with TunWan(2, LinkProfile.rtt(10, loss=0.05), seed=2) as wan:
        _, sent, got, received = send(wan, 1 << 20)
        stats = wan.stats()
    assert stats[(1, 2)]["dropped_random"] > 0
    assert got == 1 << 20 and received == sent
