"""The status dashboard's line for model transfers in flight (``/api/status`` ``transfers``)."""

from __future__ import annotations

import pytest
from test_dashboard import draw, node_id, peer, snapshot


@pytest.mark.parametrize("width", [80, 160])
def test_a_running_transfer_shows_progress_rate_and_holders(width: int) -> None:
    snap = snapshot([peer(0)])
    snap["transfers"] = [
        {"model": "qwen2-7b", "id": "ab" * 6, "kind": "stage", "layers": [9, 18], "state": "fetching",
         "bytes_done": 3 * 2**30, "bytes_total": 4 * 2**30, "rate_bytes_s": 11 * 2**20, "elapsed_s": 280.0,
         "holders": [{"node_id": node_id("beta"), "name": "beta", "bytes": 2**30, "dropped": None, "bad": False},
                     {"node_id": node_id("gamma"), "name": "gamma", "bytes": 0, "dropped": "bad sha256",
                      "bad": True}], "error": None},
        {"model": "done-one", "kind": "whole", "layers": None, "state": "done", "bytes_done": 1, "bytes_total": 1,
         "holders": []},
    ]
    text = draw(snap, width, 30)
    assert "qwen2-7b layers 9-18" in text and "75%" in text
    assert "done-one" not in text  # only transfers in flight
    if width == 160:
        assert "from beta" in text and "gamma" not in text.split("from beta")[1].splitlines()[0]


def test_a_chain_being_placed_shows_each_stage_fetch_with_rate_and_eta() -> None:
    snap = snapshot([peer(0)])
    w1, w2 = node_id("w1"), node_id("w2")
    snap["splits"] = [{"model": "tiny", "state": "placing", "reason": "planning the chain", "stages": [
        {"node_id": snap["node_id"], "name": "me", "layers": [0, 2],
         "fetch": {"bytes_done": 10 * 2**20, "bytes_total": 10 * 2**20, "rate_bytes_s": 5 * 2**20, "eta_s": 0.0}},
        {"node_id": w1, "name": "w1", "layers": [2, 4],
         "fetch": {"bytes_done": 5 * 2**20, "bytes_total": 20 * 2**20, "rate_bytes_s": 2**20, "eta_s": 15.0}},
        {"node_id": w2, "name": "w2", "layers": [4, 6], "fetch": None}]}]
    text = draw(snap, 160, 40)
    lines = {ln.split("stage ", 1)[1].split("  ")[0]: ln for ln in text.splitlines() if "   stage " in ln}
    assert set(lines) == {"alpha 0-1", "w1 2-3"}  # w2 reported no fetch: no line
    assert "25%" in lines["w1 2-3"] and "1 MiB/s" in lines["w1 2-3"] and "ETA 15s" in lines["w1 2-3"]
    assert "100%" in lines["alpha 0-1"] and "ETA" not in lines["alpha 0-1"]
