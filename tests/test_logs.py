"""The pretty event sink of ``meshllm serve``: transfers as progress bars on a terminal, plain lines elsewhere."""

from __future__ import annotations

import io

from rich.console import Console

from meshllm.events import from_wire
from meshllm.logs import event_sink

EVENTS = [from_wire(event) for event in [
    {"type": "transfer_started", "ts": 1.0, "model": "tiny", "id": "ab" * 32, "kind": "hub-stage", "layers": [2, 4]},
    {"type": "transfer_progress", "ts": 2.0, "model": "tiny", "id": "ab" * 32, "kind": "hub-stage", "layers": [2, 4],
     "bytes_done": 3 << 20, "bytes_total": 12 << 20},
    {"type": "transfer_done", "ts": 3.0, "model": "tiny", "id": "ab" * 32, "kind": "hub-stage", "layers": [2, 4],
     "bytes": 12 << 20},
]]


def test_a_terminal_draws_a_bar_while_a_stage_fetches() -> None:
    out = io.StringIO()
    sink = event_sink("pretty", Console(file=out, force_terminal=True, width=120, highlight=False))
    sink(EVENTS[0])
    sink(EVENTS[1])
    drawn = out.getvalue()
    assert "tiny layers 2-4" in drawn and "transfer_progress" not in drawn
    sink(EVENTS[2])
    assert "transfer_done" in out.getvalue()


def test_elsewhere_progress_stays_plain_lines() -> None:
    out = io.StringIO()
    sink = event_sink("pretty", Console(file=out, force_terminal=False, width=200, highlight=False))
    for event in EVENTS:
        sink(event)
    lines = out.getvalue().splitlines()
    assert [ln.split()[1] for ln in lines] == ["transfer_started", "transfer_progress", "transfer_done"]
    assert "\x1b" not in out.getvalue()
