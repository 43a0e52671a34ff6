"""Shared CLI option checks: bad values are usage errors (exit 2) with one clear line, never a traceback."""

from __future__ import annotations

import pytest
from nodes import meshllm


@pytest.mark.parametrize("value", ["nan", "inf", "-1", "0", "abc", "2e6"])
def test_max_memory_must_be_a_finite_size(value: str) -> None:
    out = meshllm("plan", "default", "--max-memory", value)
    assert out.returncode == 2 and "--max-memory" in out.stderr and "Traceback" not in out.stderr


@pytest.mark.parametrize("value", ["garbage", "/ip4/127.0.0.1/tcp/x/p2p/Qm", "/ip4/127.0.0.1/udp/1/p2p/Qm",
                                   "/ip4/127.0.0.1/tcp/4001"])
def test_dht_bootstrap_must_be_a_multiaddr(value: str) -> None:
    out = meshllm("discover", "--no-mdns", "--dht-bootstrap", value, "--timeout", "1")
    assert out.returncode == 2 and "--dht-bootstrap" in out.stderr and "Traceback" not in out.stderr
