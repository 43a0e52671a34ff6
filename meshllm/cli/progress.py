"""Progress of a long fetch on the command line: a bar on a terminal, plain lines otherwise.

``meshllm models pull hf:...`` reports bytes from the download's threads; on a terminal they draw a
rich progress bar (bytes, rate, time left) on stderr, and anywhere else (a pipe, a log file, CI) a
plain line every :data:`LINE_STEP` of the total, so a log shows progress without control codes.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TextIO

from rich.console import Console
from rich.progress import (
    BarColumn,
    DownloadColumn,
    Progress,
    TextColumn,
    TimeRemainingColumn,
    TransferSpeedColumn,
)

from meshllm.cli.dashboard import fmt_bytes
from meshllm.models.hub_fetch import Report

LINE_STEP = 0.1
"""A plain line each time another tenth of the bytes arrived."""



@contextmanager
def progress_report(label: str, stream: TextIO | None = None) -> Iterator[Report]:
    """A ``report(bytes_done, bytes_total)`` callback (thread-safe) that shows ``label``'s progress on ``stream``."""
    out = stream or sys.stderr
    if out.isatty():
        with Progress(TextColumn("{task.description}"), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
                      TimeRemainingColumn(), console=Console(file=out), transient=False) as bar:
            task = bar.add_task(label, total=None)

            def draw(done: int, total: int) -> None:
                bar.update(task, completed=done, total=total or None)

            yield draw
        return
    lock = threading.Lock()
    shown = [-1]

    def line(done: int, total: int) -> None:
        step = int(done / total / LINE_STEP) if total else 0
        with lock:
            if step <= shown[0]:
                return
            shown[0] = step
        percent = f"{100 * done / total:.0f}%" if total else "?%"
        print(f"{label}: {percent} ({fmt_bytes(done)} of {fmt_bytes(total)})", file=out, flush=True)

    yield line
