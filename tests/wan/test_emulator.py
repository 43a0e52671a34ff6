"""The UDP forwarder with real sockets on 127.0.0.1: per-link delays both ways, loss, cap, live changes.

Each test binds plain UDP sockets on the nodes' real ports (what a meshllm endpoint does) and sends
to fronts. Timing bounds are one-sided where load can only add: a datagram may be late on a busy
machine, never early by more than the emulator's sub-millisecond aim.
"""

from __future__ import annotations

import socket
import statistics
import threading
import time
from collections.abc import Iterator

import pytest

from wan import LinkProfile, WanEmulator, WanError, WanNode

EARLY_S = 0.002


def bind(node: WanNode) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.bind(("127.0.0.1", node.real_port))
    sock.settimeout(2.0)
    return sock


def echo_forever(sock: socket.socket) -> None:
    def run() -> None:
        while True:
            try:
                data, addr = sock.recvfrom(65535)
            except OSError:
                return
            sock.sendto(data, addr)

    threading.Thread(target=run, daemon=True).start()


def round_trips(sock: socket.socket, front: int, n: int) -> list[float]:
    out = []
    for i in range(n):
        started = time.perf_counter()
        sock.sendto(i.to_bytes(4, "big"), ("127.0.0.1", front))
        data, _ = sock.recvfrom(65535)
        assert int.from_bytes(data, "big") == i
        out.append(time.perf_counter() - started)
    return out


@pytest.fixture
def wan() -> Iterator[WanEmulator]:
    with WanEmulator(seed=5) as emulator:
        yield emulator


def test_each_pair_has_its_own_link_whoever_sends(wan: WanEmulator) -> None:
    a, b, c = wan.add_node("a"), wan.add_node("b"), wan.add_node("c")
    wan.set_link("a", "b", LinkProfile(delay_ms=5), reverse=LinkProfile(delay_ms=25))
    wan.set_link("a", "c", LinkProfile.rtt(10))
    sa, sb, sc = bind(a), bind(b), bind(c)
    echo_forever(sb)
    echo_forever(sc)
    ab = statistics.median(round_trips(sa, b.front_port, 15))
    ac = statistics.median(round_trips(sa, c.front_port, 15))
    assert 0.030 - EARLY_S <= ab < 0.030 + 0.015
    assert 0.010 - EARLY_S <= ac < 0.010 + 0.015
    stats = wan.stats()
    assert stats[("a", "b")].sent == stats[("b", "a")].sent == 15
    assert stats[("a", "c")].sent == 15 and ("b", "c") not in stats
    # b dialing a goes through a's front, but it is the same pair: b -> a still takes 25 ms
    echo_forever(sa)
    started = time.perf_counter()
    sb.sendto(b"ping", ("127.0.0.1", a.front_port))
    assert sb.recvfrom(100)[0] == b"ping"
    assert time.perf_counter() - started >= 0.030 - EARLY_S


def test_a_stranger_travels_on_the_default_link() -> None:
    with WanEmulator(LinkProfile.rtt(20)) as wan:
        b = wan.add_node("b")
        echo_forever(bind(b))
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as stranger:
            stranger.settimeout(2.0)
            assert statistics.median(round_trips(stranger, b.front_port, 5)) >= 0.020 - EARLY_S
        assert wan.stats()[("?", "b")].sent == 5


def test_loss_drops_datagrams_in_both_directions(wan: WanEmulator) -> None:
    a, b = wan.add_node("a"), wan.add_node("b")
    wan.set_link("a", "b", LinkProfile(loss=0.2))
    sa, sb = bind(a), bind(b)
    sa.settimeout(0.02)
    echo_forever(sb)
    answered = 0
    for i in range(400):
        sa.sendto(i.to_bytes(4, "big"), ("127.0.0.1", b.front_port))
        try:
            while int.from_bytes(sa.recvfrom(100)[0], "big") != i:
                pass
            answered += 1
        except TimeoutError:
            pass
    stats = wan.stats()
    assert 0.5 < answered / 400 < 0.78  # 0.8 x 0.8 = 0.64 of round trips survive
    assert stats[("a", "b")].dropped_random > 40 and stats[("b", "a")].dropped_random > 25
    assert stats[("b", "a")].sent - 5 <= answered <= stats[("b", "a")].sent  # a few may come back late


def test_bandwidth_cap_paces_a_burst(wan: WanEmulator) -> None:
    a, b = wan.add_node("a"), wan.add_node("b")
    wan.set_link("a", "b", LinkProfile(bandwidth_mbps=2, queue_ms=1000))  # 1,250 B = 5 ms on the wire
    sa, sb = bind(a), bind(b)
    started = time.perf_counter()
    for _ in range(40):
        sa.sendto(b"x" * 1250, ("127.0.0.1", b.front_port))
    for _ in range(40):
        sb.recvfrom(2000)
    assert time.perf_counter() - started >= 0.200 - EARLY_S


def test_a_link_can_change_while_it_runs(wan: WanEmulator) -> None:
    a, b = wan.add_node("a"), wan.add_node("b")
    sa, sb = bind(a), bind(b)
    echo_forever(sb)
    assert statistics.median(round_trips(sa, b.front_port, 10)) < 0.010
    wan.set_all(LinkProfile.rtt(40))
    assert statistics.median(round_trips(sa, b.front_port, 5)) >= 0.040 - EARLY_S


def test_names_are_unique(wan: WanEmulator) -> None:
    wan.add_node("a")
    with pytest.raises(WanError):
        wan.add_node("a")
    with pytest.raises(WanError):
        wan.add_node("?")
