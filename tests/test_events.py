"""Node events: every type the code publishes is declared, and the wire form is the one the node always sent."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest

from meshllm import events
from meshllm.api.health import Readiness
from meshllm.events import (
    KINDS,
    EventHub,
    ModelReady,
    NodeEvent,
    PeerJoined,
    Ready,
    SplitStageFailed,
    TransferDone,
    Unrecognised,
    from_wire,
    typed_event,
)
from meshllm.logs import event_sink

PACKAGE = Path(events.__file__).parent
REPORTERS = {"publish", "on_event", "_on_event"}
"""The names every part reports an event through: the hub's method and the callbacks that lead to it."""


def published_types() -> dict[str, list[tuple[str, tuple[str, ...]]]]:
    """Every literal event type a reporter is called with in the package, with where and its field names."""
    found: dict[str, list[tuple[str, tuple[str, ...]]]] = {}
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Call) or not node.args:
                continue
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
            first = node.args[0]
            if name in REPORTERS and isinstance(first, ast.Constant) and isinstance(first.value, str):
                fields = tuple(k.arg for k in node.keywords if k.arg)
                found.setdefault(first.value, []).append((f"{path.relative_to(PACKAGE)}:{node.lineno}", fields))
    return found


def test_every_published_type_and_field_is_declared_in_the_order_it_is_sent() -> None:
    published = published_types()
    assert len(published) > 40, "the walk finds the node's reporters"
    for kind, sites in published.items():
        assert kind in KINDS, f"{kind!r} ({sites[0][0]}) is not declared in meshllm/events.py"
        declared = KINDS[kind].__struct_fields__[1:]
        for where, fields in sites:
            assert set(fields) <= set(declared), f"{where}: {kind} has no field {set(fields) - set(declared)}"
            order = [declared.index(f) for f in fields]
            assert order == sorted(order), f"{where}: {kind}'s fields go out in another order than they are sent"


def test_the_blackboard_kinds_chosen_at_run_time_are_declared() -> None:
    assert {"note_posted", "note_received"} <= KINDS.keys()  # blackboard_service picks one of the two


def test_the_wire_form_is_type_ts_and_the_fields_in_call_order() -> None:
    event = typed_event("transfer_done", model="tiny", id="ab", kind="stage", layers=[2, 4], bytes=7, took_s=1,
                        path="/x", holders=2)
    assert isinstance(event, TransferDone) and event.type == "transfer_done"
    before = {"type": "transfer_done", "ts": event.ts, "model": "tiny", "id": "ab", "kind": "stage",
              "layers": [2, 4], "bytes": 7, "took_s": 1, "path": "/x", "holders": 2}
    assert json.dumps(event.wire()) == json.dumps(before)  # byte for byte, key order included
    assert from_wire(event.wire()) == event


def test_an_undeclared_type_or_field_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown node event type 'peer_jouned'"):
        EventHub().publish("peer_jouned", node_id="n")
    with pytest.raises(ValueError, match="peer_joined"):
        EventHub().publish("peer_joined", nodeid="n")


def test_a_newer_nodes_event_is_kept_as_it_was_sent() -> None:
    sent = {"type": "from_the_future", "ts": 5.5, "x": 1}
    event = from_wire(sent)
    assert isinstance(event, Unrecognised) and event.type == "from_the_future" and event.wire() == sent
    odd = from_wire({"type": "peer_joined", "ts": 1.0, "colour": "red"})  # a field this version lacks
    assert isinstance(odd, Unrecognised) and odd.details() == {"colour": "red"}


def test_the_json_log_line_is_unchanged(capsys: pytest.CaptureFixture[str]) -> None:
    hub = EventHub()
    hub.add_sink(event_sink("json"))
    event = hub.publish(PeerJoined(node_id="n1", name="alpha"))
    line = capsys.readouterr().out
    assert line == '{"type":"peer_joined","ts":' + json.dumps(event.ts) + ',"node_id":"n1","name":"alpha"}\n'


def test_readers_follow_the_types() -> None:
    readiness = Readiness()
    for event in (ModelReady(model="m"), SplitStageFailed(model="s", stage=1), Ready()):
        readiness.on_event(event)
    assert readiness.ready and readiness.ready_models == {"m"} and readiness.loading == {"s"}
    assert all(isinstance(cls.style, str) for cls in KINDS.values())
    assert KINDS["record_updated"].live_only and not KINDS["peer_joined"].live_only
    assert issubclass(KINDS["split_ready"], NodeEvent)
