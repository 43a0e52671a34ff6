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
