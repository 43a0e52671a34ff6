"""Shared CLI option checks: bad values are usage errors (exit 2) with one clear line, never a traceback."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from nodes import meshllm
from tinymodels import write_tiny, write_tiny_gguf


@pytest.mark.parametrize("value", ["nan", "inf", "-1", "0", "abc", "2e6"])
def test_max_memory_must_be_a_finite_size(value: str) -> None:
    out = meshllm("plan", "default", "--max-memory", value)
    assert out.returncode == 2 and "--max-memory" in out.stderr and "Traceback" not in out.stderr


@pytest.mark.parametrize("value", ["garbage", "/ip4/127.0.0.1/tcp/x/p2p/Qm", "/ip4/127.0.0.1/udp/1/p2p/Qm",
                                   "/ip4/127.0.0.1/tcp/4001"])
def test_dht_bootstrap_must_be_a_multiaddr(value: str) -> None:
    out = meshllm("discover", "--no-mdns", "--dht-bootstrap", value, "--timeout", "1")
    assert out.returncode == 2 and "--dht-bootstrap" in out.stderr and "Traceback" not in out.stderr


def test_plan_says_whether_a_file_can_be_split(tmp_path: Path) -> None:
    """A supported family is named; an unsupported one is refused with the runtime's reason, no traceback."""
    ok = meshllm("plan", str(write_tiny("qwen3moe", tmp_path / "moe.gguf")))
    assert ok.returncode == 0, ok.stderr
    assert "can be split: family qwen3moe" in ok.stdout and "2 of 4 experts per token" in ok.stdout
    assert "(4 layers): solo" in ok.stdout
    bad = meshllm("plan", str(write_tiny_gguf(tmp_path / "mamba.gguf", "mamba", {})), "--json")
    assert bad.returncode == 0 and "Traceback" not in bad.stderr, bad.stderr
    verdict = json.loads(bad.stdout)["split"]
    assert not verdict["splittable"] and "'mamba'" in verdict["reason"] and "qwen3moe" in verdict["reason"]
