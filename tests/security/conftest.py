"""Fixtures for the security tests: real owner and member nodes started through the CLI."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from nodes import NodeProcess, running_nodes, sees, wait_until


def start_pair(tmp: Path, nodes: list[NodeProcess], *owner_args: str) -> tuple[NodeProcess, NodeProcess]:
    """Owner A and member B, connected and seeing each other."""
    a = NodeProcess(tmp / "a", ["--client", *owner_args], "a")
    nodes.append(a)
    token = a.wait_ready()["invite"]
    b = NodeProcess(tmp / "b", ["--client", "--member", "--join", token], "b")
    nodes.append(b)
    b.wait_ready()
    wait_until(lambda: sees(a, b.node_id) and sees(b, a.node_id), 10.0)
    return a, b


@pytest.fixture
def pair(tmp_path: Path) -> Iterator[tuple[NodeProcess, NodeProcess]]:
    with running_nodes() as nodes:
        yield start_pair(tmp_path, nodes)
