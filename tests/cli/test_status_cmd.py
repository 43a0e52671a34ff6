"""``meshllm status`` against a real HTTP server on 127.0.0.1: ``--json``, the live dashboard in tmux,
and the one-line error when no node answers. Also the SSE reader it is built on."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from meshllm.cli.api_client import NodeApi, NodeApiError, NodeUnreachable, parse_sse

ROOT = Path(__file__).resolve().parents[2]
RUN_STATUS = "-m meshllm status"  # through the meshllm group, as a user runs it
ALPHA, BETA, GAMMA, DELTA = (c * 52 for c in "abcd")
GEMMA = {"name": "gemma-3-270m", "engine": "llama", "layers": [0, 18], "n_layers": 18}


def peer(node: str, name: str, state: str, rtt_ms: float | None) -> dict[str, Any]:
    return {"node_id": node, "name": name, "state": state, "role": "host", "path": "direct", "rtt_ms": rtt_ms,
            "models": [GEMMA], "capacity": {"ram_bytes": 24 * 2**30, "vram_bytes": 0, "cpu_cores": 2, "gflops": 9.5},
            "load": {"in_flight": 0, "queue": 0, "tok_s": 0.0}, "addr": "127.0.0.1:9440", "seq": 17}


# exactly the shape of the node's GET /api/status
FIXTURE = {
    "node_id": ALPHA, "name": "alpha", "mesh_id": "mesh-" + "b" * 26, "version": "0.1.0", "role": "host",
    "api_url": "http://127.0.0.1:9337", "mesh_addr": "127.0.0.1:9338", "uptime_s": 12.5, "models": [GEMMA],
    "peers": [peer(BETA, "beta", "alive", 0.8), peer(GAMMA, "gamma", "suspect", 23.4),
              peer(DELTA, "delta", "down", None)],
    "rtt_matrix": {ALPHA: {BETA: 0.8, GAMMA: 23.4}, BETA: {ALPHA: 0.9, GAMMA: 150.0}},
    "splits": [{"model": "gemma-3-270m", "stages": [{"node_id": ALPHA, "layers": [0, 9]},
                                                    {"node_id": BETA, "layers": [9, 18]}]}],
    "requests": {"total": 10, "failed": 0, "per_min": 3.0},
}
EVENTS = [{"type": "peer_joined", "node_id": BETA}, {"type": "model_ready", "model": "gemma-3-270m"}]


class FakeNode:
    """A threading HTTP server that answers like a node: the fixture status and an SSE stream."""

    def __init__(self) -> None:
        self.stopping = threading.Event()
        self.silent = threading.Event()  # set: event streams stay open but send nothing, not even keep-alives
        node = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:
                pass

            def do_GET(self) -> None:
                if self.path == "/api/status":
                    body = json.dumps(FIXTURE).encode()
                    self.send_response(200)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    self.wfile.write(body)
                elif self.path == "/api/events":
                    self.send_response(200)
                    self.send_header("Content-Type", "text/event-stream")
                    self.send_header("Connection", "close")
                    self.end_headers()
                    for event in EVENTS:
                        data = json.dumps({**event, "ts": time.time()})
                        self.wfile.write(f"event: {event['type']}\ndata: {data}\n\n".encode())
                    self.wfile.flush()
                    while not node.stopping.wait(0.2):
                        if not node.silent.is_set():
                            self.wfile.write(b": keep-alive\n\n")
                            self.wfile.flush()
                else:
                    self.send_error(404)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.stopping.set()
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def node() -> Iterator[FakeNode]:
    fake = FakeNode()
    yield fake
    if not fake.stopping.is_set():
        fake.stop()


def free_url() -> str:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{sock.getsockname()[1]}"


def run_status(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, *RUN_STATUS.split(), *args], capture_output=True, text=True, timeout=30,
                          cwd=ROOT, env={**os.environ, **(env or {})})


# --- one snapshot and errors -------------------------------------------------------------------------------


def test_json_prints_one_snapshot(node: FakeNode) -> None:
    out = run_status("--api", node.url, "--json")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == FIXTURE


def test_piped_prints_the_dashboard_once(node: FakeNode) -> None:
    """Without a terminal (a pipe, a script) the dashboard is drawn once and the command ends."""
    out = run_status("--api", node.url)
    assert out.returncode == 0, out.stderr
    assert FIXTURE["name"] in out.stdout and "peers (" in out.stdout and "RTT matrix" in out.stdout


def test_api_url_from_environment(node: FakeNode) -> None:
    out = run_status("--json", env={"MESHLLM_API": node.url + "/"})
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["name"] == "alpha"


@pytest.mark.parametrize("extra", [[], ["--json"]])
def test_no_node_is_one_line_error(extra: list[str]) -> None:
    url = free_url()
    out = run_status("--api", url, *extra)
    assert out.returncode == 1
    assert out.stderr == f"error: no meshllm node is running at {url} (start one with `meshllm serve`)\n"
    assert out.stdout == ""


def test_not_a_node_is_one_line_error(node: FakeNode) -> None:
    out = run_status("--api", node.url + "/nope", "--json")
    assert out.returncode == 1 and "is it a meshllm node?" in out.stderr and "Traceback" not in out.stderr


def test_bad_url_is_usage_error() -> None:
    out = run_status("--api", "127.0.0.1:9337")
    assert out.returncode == 2 and "http://" in out.stderr


# --- the live dashboard in a real terminal ------------------------------------------------------------------


class Tmux:
    """A private tmux server (its own socket) running one command in a 120x40 pane."""

    def __init__(self, command: str) -> None:
        self.socket = f"meshllm-status-test-{uuid.uuid4().hex[:8]}"
        self.tmux("new-session", "-d", "-s", "t", "-x", "120", "-y", "40", "-c", str(ROOT), command)

    def tmux(self, *args: str) -> str:
        return subprocess.run(["tmux", "-L", self.socket, *args], capture_output=True, text=True, timeout=10,
                              check=True).stdout

    def screen(self) -> str:
        return self.tmux("capture-pane", "-p", "-t", "t")

    def wait_for(self, test: Callable[[str], bool], timeout: float = 15.0) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            text = self.screen()
            if test(text):
                return text
            time.sleep(0.1)
        raise AssertionError(f"screen never matched; last screen:\n{self.screen()}")

    def close(self) -> None:
        subprocess.run(["tmux", "-L", self.socket, "kill-server"], capture_output=True, timeout=10)


@pytest.fixture
def tmux_dashboard(node: FakeNode, tmp_path: Path) -> Iterator[tuple[Tmux, Path]]:
    if shutil.which("tmux") is None:
        pytest.skip("tmux is not installed (apt-get install -y tmux); the live dashboard needs a real terminal")
    after = tmp_path / "after.txt"
    script = (f"{sys.executable} {RUN_STATUS} --api {node.url} --interval 0.3; "
              f"echo exit=$? > {after}; stty -a >> {after}; echo DONE; sleep 60")
    term = Tmux(f"bash -c {json.dumps(script)}")
    try:
        yield term, after
    finally:
        term.close()


def leaves_cleanly(term: Tmux, after: Path) -> None:
    screen = term.wait_for(lambda s: "DONE" in s)
    assert "RTT matrix" not in screen  # the alternate screen is gone
    state = after.read_text()
    assert state.startswith("exit=0")
    settings = state.split()
    assert "icanon" in settings and "echo" in settings  # cbreak mode undone


def test_live_dashboard_shows_node_and_quits_on_q(tmux_dashboard: tuple[Tmux, Path]) -> None:
    term, after = tmux_dashboard
    screen = term.wait_for(lambda s: "RTT matrix" in s and "model_ready" in s)
    for text in ("alpha", "beta", "gamma", "delta", "suspect", "RTT matrix", "split topology", "alpha 0-8",
                 "peer_joined", "connected", "mesh-" + "b" * 26):
        assert text in screen, screen
    assert "Traceback" not in screen
    term.tmux("send-keys", "-t", "t", "q")
    leaves_cleanly(term, after)


def test_node_going_away_is_shown_then_ctrl_c_leaves(node: FakeNode, tmux_dashboard: tuple[Tmux, Path]) -> None:
    term, after = tmux_dashboard
    term.wait_for(lambda s: "beta" in s)
    node.stop()
    screen = term.wait_for(lambda s: "node unreachable, retrying" in s)
    assert "beta" in screen  # the last data stays on screen
    term.tmux("send-keys", "-t", "t", "C-c")
    leaves_cleanly(term, after)


# --- api_client ---------------------------------------------------------------------------------------------


def test_parse_sse_handles_comments_multiline_and_junk() -> None:
    lines = [": keep-alive", "", "event: peer_left", 'data: {"ts": 1,', 'data:  "node_id": "x"}', "",
             "data: not json", "", "data: [1]", "", "id: 7", "retry: 100", 'data: {"ts": 2, "type": "t"}', ""]
    assert list(parse_sse(lines)) == [{"ts": 1, "node_id": "x", "type": "peer_left"}, {"ts": 2, "type": "t"}]


def test_open_events_reads_stream_and_ends_when_idle(node: FakeNode) -> None:
    node.silent.set()
    start = time.monotonic()
    with NodeApi(node.url).events(idle_timeout=0.5) as events:
        got = [event["type"] for event in events]  # ends by itself once the stream goes quiet
    assert got == ["peer_joined", "model_ready"]
    assert time.monotonic() - start < 3


def test_open_events_without_node(node: FakeNode) -> None:
    node.stop()
    with pytest.raises(NodeUnreachable, match="meshllm serve"), NodeApi(node.url).events(connect_timeout=1.0):
        pass


def test_get_json_errors(node: FakeNode) -> None:
    assert NodeApi(node.url).get_json("/api/status")["name"] == "alpha"
    with pytest.raises(NodeApiError, match="404"):
        NodeApi(node.url).get_json("/nope")
    url = free_url()
    with pytest.raises(NodeUnreachable, match=f"no meshllm node is running at {url}"):
        NodeApi(url).get_json("/api/status", timeout=1.0)
