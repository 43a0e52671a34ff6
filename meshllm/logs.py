"""Logging for a running node: ``pretty`` (for people, on stderr) or ``json`` (one event per line on stdout).

In json mode every hub event is one JSON object on stdout, so scripts and tests can wait for
``{"type": "ready", ...}``; ordinary log records become ``{"type": "log", ...}`` objects too.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from typing import Any

from rich.console import Console
from rich.logging import RichHandler
from rich.progress import (
    BarColumn,
    DownloadColumn,
    Progress,
    TaskID,
    TextColumn,
    TimeRemainingColumn,
    TransferSpeedColumn,
)

from meshllm.events import NodeEvent, Ready, TransferDone, TransferFailed, TransferProgress, TransferStarted

Event = dict[str, Any]


class JsonLineHandler(logging.Handler):
    """Log records as JSON lines on stdout."""

    def emit(self, record: logging.LogRecord) -> None:
        emit_json({"type": "log", "ts": round(record.created, 3), "level": record.levelname.lower(),
                   "logger": record.name, "message": record.getMessage()})


def emit_json(event: Event) -> None:
    """Write one event as a JSON line and flush (readers wait on it)."""
    sys.stdout.write(json.dumps(event, default=str, separators=(",", ":")) + "\n")
    sys.stdout.flush()


def configure(log_format: str, verbose: bool = False) -> None:
    """Set up the root logger for ``meshllm serve``."""
    level = logging.DEBUG if verbose else logging.INFO
    root = logging.getLogger()
    root.handlers.clear()
    if log_format == "json":
        root.addHandler(JsonLineHandler())
    else:
        root.addHandler(RichHandler(console=Console(stderr=True), show_path=False, rich_tracebacks=False))
    root.setLevel(level)
    for noisy in ("uvicorn", "uvicorn.access", "uvicorn.error", "quic", "httpx"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


def event_sink(log_format: str, console: Console | None = None, verbose: bool = False) -> Any:
    """A hub sink that prints events: JSON lines, or one readable line each on stderr.

    The gossip heartbeat (:attr:`~meshllm.events.NodeEvent.live_only` events: a ``record_updated``
    for every member's refresh, two a second on a mesh of 50) is printed only when ``verbose``: it
    buried everything else in the log, and writing it was 7 % of an idle member's time. The
    ``/api/events`` stream still carries it.

    On a terminal, model transfers (a stage fetching its layers, a download) are drawn as progress
    bars (bytes, rate, time left) while they run, instead of a ``transfer_progress`` line a second;
    elsewhere (a pipe, a log file) those stay plain lines.
    """
    if log_format == "json":
        return lambda event: None if event.live_only and not verbose else emit_json(event.wire())
    console = console or Console(stderr=True, highlight=False)
    bars = TransferBars(console) if console.is_terminal else None

    def pretty(event: NodeEvent) -> None:
        if event.live_only and not verbose:
            return
        if isinstance(event, Ready):  # ``meshllm serve`` prints it as a readable summary instead
            return
        if bars is not None and bars.handle(event):
            return
        fields = " ".join(f"{k}={v}" for k, v in event.details().items())
        console.print(f"[dim]{time.strftime('%H:%M:%S')}[/] [bold]{event.type}[/] {fields}")

    return pretty


class TransferBars:
    """Progress bars of the transfers running now, shown only while there are some."""

    def __init__(self, console: Console) -> None:
        self.console = console
        self.progress: Progress | None = None
        self.tasks: dict[tuple[str, str], TaskID] = {}

    def handle(self, event: NodeEvent) -> bool:
        """Draw a transfer's event as a bar; True when it needs no line of its own."""
        if not isinstance(event, TransferStarted | TransferProgress | TransferDone | TransferFailed):
            return False
        fields = event.details()
        layers = fields.get("layers")
        key = (str(fields.get("id") or fields.get("model")), f"{layers[0]}-{layers[1]}" if layers else "")
        if isinstance(event, TransferDone | TransferFailed):
            task = self.tasks.pop(key, None)
            if task is not None and self.progress is not None:
                self.progress.remove_task(task)
            if not self.tasks and self.progress is not None:
                self.progress.stop()
                self.progress = None
            return False  # the outcome gets its line
        if self.progress is None:
            self.progress = Progress(TextColumn("{task.description}"), BarColumn(), DownloadColumn(),
                                     TransferSpeedColumn(), TimeRemainingColumn(), console=self.console,
                                     transient=True)
            self.progress.start()
        task = self.tasks.get(key)
        if task is None:
            what = f"layers {layers[0]}-{layers[1]}" if layers else str(fields.get("kind", ""))
            task = self.tasks[key] = self.progress.add_task(f"{fields.get('model', '?')} {what}", total=None)
        if isinstance(event, TransferProgress):
            self.progress.update(task, completed=fields.get("bytes_done") or 0, total=fields.get("bytes_total") or None)
            return True
        return False
