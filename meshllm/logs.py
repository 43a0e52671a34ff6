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

Event = dict[str, Any]
SUMMARISED = frozenset({"ready"})
"""Events that ``meshllm serve`` prints as a readable summary in pretty mode instead of a log line."""


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


def event_sink(log_format: str) -> Any:
    """A hub sink that prints events: JSON lines, or one readable line each on stderr."""
    if log_format == "json":
        return emit_json
    console = Console(stderr=True, highlight=False)

    def pretty(event: Event) -> None:
        if event["type"] in SUMMARISED:
            return
        fields = " ".join(f"{k}={v}" for k, v in event.items() if k not in ("type", "ts"))
        console.print(f"[dim]{time.strftime('%H:%M:%S')}[/] [bold]{event['type']}[/] {fields}")

    return pretty
