"""A member that pushes forged, replayed, oversized and over-rate blackboard notes over real QUIC: every
honest member refuses each with its reason and keeps only what is genuine."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from nodes import NodeProcess, running_nodes, wait_until

from meshllm.mesh.blackboard import RATE_PER_MINUTE

pytestmark = pytest.mark.timeout(120)

FORGER = Path(__file__).with_name("board_forger.py")


def test_forged_replayed_oversized_and_over_rate_notes_are_refused_with_reasons(tmp_path: Path) -> None:
    with running_nodes() as nodes:
        honest = NodeProcess(tmp_path / "h", ["--client"], "honest")
        nodes.append(honest)
        token = honest.wait_ready()["invite"]
        forger = NodeProcess(tmp_path / "f", ["--client", "--member", "--join", token], "forger", entry=(str(FORGER),))
        nodes.append(forger)
        forger.wait_ready()
        wait_until(lambda: len(honest.status()["peers"]) == 1, 20.0)
        posted = httpx.post(f"{forger.api}/api/blackboard", json={"text": "DONE: attack sent"},
                            headers=forger.admin_headers, timeout=10)
        assert posted.status_code == 200, posted.text

        def refusals() -> dict[str, dict[str, object]]:
            return {e["code"]: e for e in honest.events if e["type"] == "note_refused"}

        wait_until(lambda: {"forged", "replayed", "too-large", "rate"} <= refusals().keys(), 10.0)
        for code, event in refusals().items():
            assert event["source"] == forger.node_id and event["reason"], (code, event)
        assert "4 KB" in str(refusals()["too-large"]["reason"])
        # 13 valid notes of one minute (the genuine one, eleven of the burst, the one posted), in whatever
        # order they arrive: ten are kept, the others refused as over the rate
        wait_until(lambda: len(notes(honest)) == RATE_PER_MINUTE, 5.0)
        texts = [str(n["text"]) for n in notes(honest)]
        assert texts.count("STATUS: genuine") == 1 and not any("tampered" in t or "xxxx" in t for t in texts)
        assert all(t.startswith(("STATUS: genuine", "STATUS: burst", "DONE: attack sent")) for t in texts), texts
        rated = lambda: [e for e in honest.events if e["type"] == "note_refused" and e["code"] == "rate"]  # noqa: E731
        wait_until(lambda: len(rated()) == 3, 5.0)


def notes(node: NodeProcess) -> list[dict[str, object]]:
    return httpx.get(f"{node.api}/api/blackboard", params={"limit": 100}, timeout=5).json()["notes"]
