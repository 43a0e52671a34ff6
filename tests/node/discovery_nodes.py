"""Helpers for the discovery integration tests: any node command as a :class:`NodeProcess`, and the CLI.

``NodeProcess`` always runs ``meshllm serve`` on 127.0.0.1; these tests also need ``meshllm join
<mesh-id>`` and nodes inside network namespaces (``ip netns exec NS ...``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

from nodes import NodeProcess


class CliNode(NodeProcess):
    """A node (``serve`` or ``join``, maybe inside a namespace) that also reports its DHT address."""

    def dht_addr(self, timeout: float = 30.0) -> str:
        """The node's DHT multiaddr (from its ``dht_ready`` event)."""
        return self.wait_event(lambda e: e["type"] == "dht_ready", timeout)["multiaddrs"][0]


def meshllm(*args: str, prefix: tuple[str, ...] = (), timeout: float = 60.0) -> subprocess.CompletedProcess[str]:
    """Run one CLI command to completion."""
    return subprocess.run([*prefix, sys.executable, "-m", "meshllm", *args], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, "PYTHONUNBUFFERED": "1"})


def meshllm_json(*args: str, prefix: tuple[str, ...] = (), timeout: float = 60.0) -> Any:
    """Run a CLI command with ``--json`` and decode its stdout (AssertionError with stderr on failure)."""
    done = meshllm(*args, "--json", prefix=prefix, timeout=timeout)
    assert done.returncode == 0, f"meshllm {' '.join(args)} exited {done.returncode}: {done.stderr}"
    return json.loads(done.stdout)
