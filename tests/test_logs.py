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


def test_the_gossip_heartbeat_is_logged_only_when_verbose(capsys) -> None:
    heartbeat, joined = from_wire({"type": "record_updated", "ts": 1.0, "node_id": "n1", "seq": 7}), \
        from_wire({"type": "peer_joined", "ts": 1.0, "node_id": "n1", "name": "alpha"})
    for verbose in (False, True):
        out = io.StringIO()
        pretty = event_sink("pretty", Console(file=out, force_terminal=False, width=200), verbose=verbose)
        as_json = event_sink("json", verbose=verbose)
        for event in (heartbeat, joined):
            pretty(event)
            as_json(event)
        logged = [ln.split()[1] for ln in out.getvalue().splitlines()]
        json_types = [line.split('"type":"')[1].split('"')[0] for line in capsys.readouterr().out.splitlines()]
        want = ["record_updated", "peer_joined"] if verbose else ["peer_joined"]
        assert logged == want and json_types == want
