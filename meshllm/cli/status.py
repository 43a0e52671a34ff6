"""``meshllm status``: one snapshot as JSON, or a live full-screen dashboard of a running node.

The dashboard polls ``GET /api/status`` every ``--interval`` and follows ``GET /api/events`` in a
background thread that reconnects on its own. A node that goes away mid-session turns the header
red ("node unreachable, retrying") instead of ending the session; only a node that is missing at
start is an error (one line, exit 1). The terminal is always restored, whether the user leaves
with ``q``, Ctrl-C, or an error.
"""

from __future__ import annotations

import collections
import os
import select
import signal
import sys
import termios
import threading
import time
import tty
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import click
from rich.console import Console
from rich.live import Live

from meshllm.cli.api_client import NodeApi, NodeApiError
from meshllm.cli.common import api_option, echo_json, json_option
from meshllm.cli.dashboard import MAX_EVENTS, Link, render
from meshllm.errors import MeshllmError
from meshllm.events import NodeEvent, from_wire

TICK_S = 0.2  # how often keys and new events are checked between polls


class EventFeed:
    """Follows the node's event stream in a daemon thread and keeps the latest events.

    The thread reconnects with a doubling back-off (capped) after the stream ends or the node
    goes away. It is a daemon because a blocked socket read cannot be interrupted portably; the
    process exits right after the dashboard closes, so nothing is left behind.
    """

    def __init__(self, api: NodeApi, keep: int = MAX_EVENTS) -> None:
        self._api = api
        self._events: collections.deque[NodeEvent] = collections.deque(maxlen=keep)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._live = False
        self._version = 0
        self._thread = threading.Thread(target=self._run, name="meshllm-status-events", daemon=True)

    def start(self) -> None:
        """Begin following the stream."""
        self._thread.start()

    def stop(self) -> None:
        """Ask the thread to end; it does at its next event or reconnect."""
        self._stop.set()

    def view(self) -> tuple[list[NodeEvent], bool, int]:
        """The kept events (oldest first), whether the stream is connected, and a change counter."""
        with self._lock:
            return list(self._events), self._live, self._version

    def _set(self, live: bool, event: NodeEvent | None = None) -> None:
        with self._lock:
            if event is not None:
                self._events.append(event)
            if event is not None or live != self._live:
                self._version += 1
            self._live = live

    def _run(self) -> None:
        backoff = 0.5
        while not self._stop.is_set():
            try:
                with self._api.events() as events:
                    self._set(True)
                    backoff = 0.5
                    for event in events:
                        if self._stop.is_set():
                            return
                        self._set(True, from_wire(event))
            except MeshllmError:
                self._set(False)
                backoff = min(backoff * 2, 5.0)
            self._stop.wait(backoff)


def _sleep(timeout: float) -> str:
    time.sleep(max(0.0, timeout))
    return ""


@contextmanager
def key_reader() -> Iterator[Callable[[float], str]]:
    """Put a TTY stdin in cbreak mode (keys arrive at once, unechoed) and restore it afterwards.

    Yields a function ``wait(timeout) -> str`` that returns the keys typed within ``timeout``
    seconds ("" if none). Without a TTY it only sleeps; Ctrl-C still ends the dashboard.
    """
    if not sys.stdin.isatty():
        yield _sleep
        return
    fd = sys.stdin.fileno()
    saved = termios.tcgetattr(fd)

    def wait(timeout: float) -> str:
        ready, _, _ = select.select([fd], [], [], max(0.0, timeout))
        return os.read(fd, 64).decode(errors="replace") if ready else ""

    try:
        tty.setcbreak(fd)
        yield wait
    finally:
        termios.tcsetattr(fd, termios.TCSADRAIN, saved)


def _interrupt(signum: int, frame: Any) -> None:
    """SIGTERM ends the dashboard like Ctrl-C, so the terminal is restored on the way out."""
    raise KeyboardInterrupt


def fetch_status(api: NodeApi, timeout: float) -> dict[str, Any]:
    """One ``/api/status`` snapshot, checked to be a JSON object."""
    snapshot = api.get_json("/api/status", timeout=timeout)
    if not isinstance(snapshot, dict):
        raise NodeApiError(f"{api} answered /api/status with something that is not a status object")
    return snapshot


def run_dashboard(api: NodeApi, snapshot: dict[str, Any], interval: float) -> None:
    """Draw the dashboard until ``q`` or Ctrl-C, polling the node every ``interval`` seconds."""
    poll_timeout = min(2.0, max(0.5, interval))
    console = Console()
    feed = EventFeed(api)
    feed.start()
    reachable, last_ok = True, time.time()
    next_poll = time.monotonic() + interval
    previous_term = signal.signal(signal.SIGTERM, _interrupt)
    try:
        with key_reader() as wait, Live(console=console, screen=True, auto_refresh=False) as live:
            while True:
                events, events_live, version = feed.view()
                link = Link(api.url, reachable, events_live, last_ok)
                width, height = console.size
                live.update(render(snapshot, events, link, now=time.time(), width=width, height=height), refresh=True)
                drawn_version = version
                while True:
                    if "q" in wait(min(TICK_S, next_poll - time.monotonic())).lower():
                        return
                    if time.monotonic() >= next_poll:
                        try:
                            snapshot, reachable, last_ok = fetch_status(api, poll_timeout), True, time.time()
                        except MeshllmError:
                            reachable = False
                        next_poll = time.monotonic() + interval
                        break
                    if feed.view()[2] != drawn_version:
                        break
    except KeyboardInterrupt:
        return
    finally:
        feed.stop()
        signal.signal(signal.SIGTERM, previous_term)


@click.command("status")
@api_option
@json_option
@click.option("--interval", type=click.FloatRange(min=0.1), default=1.0, show_default=True,
              help="Seconds between refreshes of the dashboard.")
def status(api: NodeApi, as_json: bool, interval: float) -> None:
    """Show a running node: peers, RTT heat map, split topology and events (q or Ctrl-C to leave).

    When stdout is not a terminal (a pipe, a file, a script), it prints the dashboard once and exits.
    """
    snapshot = fetch_status(api, timeout=5.0)
    if as_json:
        echo_json(snapshot)
        return
    if not sys.stdout.isatty():
        console = Console(width=max(100, Console().size.width))
        console.print(render(snapshot, [], Link(api.url), now=time.time(), width=console.size.width))
        return
    run_dashboard(api, snapshot, interval)
