"""Run real meshllm nodes as subprocesses through the CLI, for integration tests and benchmarks.

Each node logs JSON lines on stdout; a reader thread collects them so tests can wait for events
(``ready``, ``peer_joined``, ...) with deadlines. Nodes bind only to 127.0.0.1, on free ports.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx

Event = dict[str, Any]

HTTP = httpx.Client(limits=httpx.Limits(max_connections=512, max_keepalive_connections=512, keepalive_expiry=2.0))
"""One client for every call the harness makes (thread-safe, pooled): ``httpx.get`` builds a client and its
TLS context per call, 23 ms of CPU here, which on a mesh of 50 read at once was half a core. A pooled
connection idle for 2 s is not reused: the node's server closes idle ones after 5 s (uvicorn's keep-alive),
and a call on one it had just closed failed with "Server disconnected without sending a response"."""


class NodeProcess:
    """One ``meshllm serve`` (or ``join``) subprocess; ``prefix`` runs it inside a network namespace."""

    def __init__(self, home: Path, args: list[str], name: str, prefix: Sequence[str] | None = None, *,
                 command: str = "serve", mesh_host: str = "127.0.0.1", entry: Sequence[str] = ("-m", "meshllm")
                 ) -> None:
        """``prefix`` wraps the command (tests/netns runs nodes under ``ip netns exec NS``); ``entry`` is
        what Python runs (a test's wrapper script instead of the CLI: tests/security/forger.py)."""
        self.home = home
        self.name = name
        cmd = [*(prefix or []), sys.executable, *entry, command, "--home", str(home), "--name", name,
               "--port", "0", "--mesh-port", "0", "--mesh-host", mesh_host, "--log-format", "json", *args]
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        self.events: list[Event] = []
        self._queue: queue.Queue[Event] = queue.Queue()
        self.stderr: list[str] = []
        threading.Thread(target=self._read_stdout, daemon=True).start()
        threading.Thread(target=self._read_stderr, daemon=True).start()
        self.ready: Event = {}

    def _read_stdout(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            try:
                event = json.loads(line)
            except json.JSONDecodeError:
                continue
            self.events.append(event)
            self._queue.put(event)

    def _read_stderr(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.stderr.append(line)

    def wait_event(self, predicate: Callable[[Event], bool], timeout: float) -> Event:
        """The first event (past or future) matching ``predicate``; AssertionError after ``timeout``."""
        for event in list(self.events):
            if predicate(event):
                return event
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            try:
                event = self._queue.get(timeout=min(left, 0.1))
            except queue.Empty:
                if self.proc.poll() is not None:
                    break
                continue
            if predicate(event):
                return event
        raise AssertionError(f"node {self.name}: no matching event within {timeout} s "
                             f"(exit code {self.proc.poll()}); stderr tail: {''.join(self.stderr[-20:])}")

    def wait_ready(self, timeout: float = 60.0) -> Event:
        self.ready = self.wait_event(lambda e: e["type"] == "ready", timeout)
        return self.ready

    @property
    def api(self) -> str:
        return self.ready["api_url"]

    @property
    def node_id(self) -> str:
        return self.ready["node_id"]

    @property
    def mesh_addr(self) -> str:
        return self.ready["mesh_addr"]

    def dht_addr(self, timeout: float = 30.0) -> str:
        """The node's DHT multiaddr (from its ``dht_ready`` event; the node needs a DHT port)."""
        return self.wait_event(lambda e: e["type"] == "dht_ready", timeout)["multiaddrs"][0]

    @property
    def admin_token(self) -> str:
        """The node's admin token (management calls need it), read from its home like the CLI does."""
        return (self.home / "admin.token").read_text().strip()

    @property
    def admin_headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.admin_token}"}

    @property
    def api_args(self) -> list[str]:
        """``--api URL --home HOME``: what a CLI command needs to call this node (it sends the admin token)."""
        return ["--api", self.api, "--home", str(self.home)]

    def status(self, timeout: float = 5.0) -> dict[str, Any]:
        return HTTP.get(self.api + "/api/status", headers=self.admin_headers, timeout=timeout).json()

    def terminate(self, timeout: float = 10.0) -> int:
        """SIGTERM (a graceful leave) and wait."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout)

    def kill(self) -> None:
        """SIGKILL: the node vanishes without a word."""
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)


def meshllm(*args: str, prefix: Sequence[str] = (), timeout: float = 60.0) -> subprocess.CompletedProcess[str]:
    """Run one CLI command to completion (``prefix`` wraps it, e.g. ``ip netns exec NS``)."""
    return subprocess.run([*prefix, sys.executable, "-m", "meshllm", *args], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, "PYTHONUNBUFFERED": "1"})


def meshllm_json(*args: str, prefix: Sequence[str] = (), timeout: float = 60.0) -> Any:
    """Run a CLI command with ``--json`` and decode its stdout (AssertionError with stderr on failure)."""
    done = meshllm(*args, "--json", prefix=prefix, timeout=timeout)
    assert done.returncode == 0, f"meshllm {' '.join(args)} exited {done.returncode}: {done.stderr}"
    return json.loads(done.stdout)


@contextmanager
def running_nodes() -> Iterator[list[NodeProcess]]:
    """A list to append started nodes to; every one is killed on exit."""
    nodes: list[NodeProcess] = []
    try:
        yield nodes
    finally:
        for node in nodes:
            node.kill()


def wait_until(predicate: Callable[[], bool], timeout: float, interval: float = 0.05) -> float:
    """Seconds until ``predicate()`` held; AssertionError after ``timeout``."""
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        if predicate():
            return time.monotonic() - start
        time.sleep(interval)
    raise AssertionError(f"condition not met within {timeout} s")


def sees(node: NodeProcess, other_id: str, states: tuple[str, ...] = ("alive", "suspect")) -> bool:
    """Whether ``node`` lists ``other_id`` in one of ``states``."""
    return any(p["node_id"] == other_id and p["state"] in states for p in node.status()["peers"])
