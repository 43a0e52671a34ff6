"""The status dashboard rendered from sample snapshots, at 80 and 160 columns."""

from __future__ import annotations

import base64
import hashlib
from typing import Any

import pytest
from rich.console import Console

from meshllm.cli.dashboard import Link, fmt_capacity, fmt_duration, fmt_ms, heat_style, render
from meshllm.events import from_wire

NOW = 1_700_000_000.0
NAMES = ["beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta", "iota", "kappa", "lambda", "mu", "nu"]
API = "http://127.0.0.1:9337"


def node_id(seed: str) -> str:
    return base64.b32encode(hashlib.sha256(seed.encode()).digest()).decode().lower().rstrip("=")[:52]


def peer(i: int, state: str = "alive", rtt_ms: float | None = 0.8) -> dict[str, Any]:
    return {
        "node_id": node_id(NAMES[i]), "name": NAMES[i], "state": state, "role": "host", "path": "direct",
        "rtt_ms": rtt_ms, "models": [{"name": "gemma-3-270m", "engine": "llama", "layers": [0, 18], "n_layers": 18}],
        "capacity": {"ram_bytes": 24 * 2**30, "vram_bytes": 0, "cpu_cores": 2, "gflops": 50.0},
        "load": {"in_flight": 1, "queue": 0, "tok_s": 31.0}, "addr": f"127.0.0.1:{9440 + i}", "seq": 17,
    }


def snapshot(peers: list[dict[str, Any]], splits: list[dict[str, Any]] | None = None,
             full_matrix: bool = True) -> dict[str, Any]:
    me = node_id("alpha")
    ids = [me] + [p["node_id"] for p in peers]
    matrix = {a: {b: 0.5 * (i + j + 1) for j, b in enumerate(ids) if a != b and (full_matrix or i + j != 1)}
              for i, a in enumerate(ids)}
    return {
        "node_id": me, "name": "alpha", "mesh_id": "mesh-" + "b" * 26, "version": "0.1.0", "role": "host",
        "api_url": API, "mesh_addr": "127.0.0.1:9338", "uptime_s": 125.0,
        "models": [{"name": "gemma-3-270m", "engine": "llama", "layers": [0, 18], "n_layers": 18}],
        "peers": peers, "rtt_matrix": matrix, "splits": splits or [],
        "requests": {"total": 10, "failed": 2, "per_min": 3.0},
    }


def draw(snap: dict[str, Any], width: int, height: int | None = None, events: list[dict[str, Any]] | None = None,
         link: Link | None = None) -> str:
    console = Console(record=True, width=width, height=height or 200, color_system="truecolor", force_terminal=True)
    typed = [from_wire(event) for event in events or []]  # as the event feed reads them off the stream
    console.print(render(snap, typed, link or Link(API), now=NOW, width=width, height=height))
    text = console.export_text()
    assert all(len(line) <= width for line in text.splitlines()), text
    if height is not None:
        assert len(text.splitlines()) <= height, text
    return text


@pytest.mark.parametrize("width", [80, 160])
def test_no_peers(width: int) -> None:
    text = draw(snapshot([]), width, 24)
    assert "alpha" in text and node_id("alpha")[:8] in text and node_id("alpha")[:9] not in text
    assert "mesh-" + "b" * 26 in text and "host" in text and "up 2m05s" in text
    assert "no peers yet" in text and "no splits" in text and "no events yet" in text
    assert "10 total" in text and "2 failed" in text and "3.0/min" in text and "connected" in text


@pytest.mark.parametrize("width", [80, 160])
def test_one_peer(width: int) -> None:
    text = draw(snapshot([peer(0)]), width, 24)
    assert "peers (1)" in text and "beta" in text and node_id("beta")[:8] in text
    assert "alive" in text and "direct" in text and "gemma-3-270m" in text and "1/0 31t/s" in text
    assert ("RAM 24 GiB · 2 cores" if width >= 120 else "24G·2c") in text
    assert "RTT matrix" in text and "·" in text


@pytest.mark.parametrize("width", [80, 160])
def test_three_peers_suspect_down_and_unknown_rtt(width: int) -> None:
    peers = [peer(0), peer(1, "suspect", 23.4), peer(2, "down", None)]
    text = draw(snapshot(peers, full_matrix=False), width, 24)
    for word in ("beta", "gamma", "delta", "suspect", "down", "23"):
        assert word in text
    matrix = text[text.index("RTT matrix"):text.index("split topology")]
    assert "?" in matrix  # alpha<->beta was never measured
    row = next(line for line in matrix.splitlines() if line.startswith("alpha"))
    assert row.split()[1:3] == ["·", "?"]


def test_twelve_peers_fit_80x24_and_say_what_is_cut() -> None:
    text = draw(snapshot([peer(i) for i in range(12)]), 80, 24, events=events(12))
    assert "peers (12)" in text and "more peers" in text and "more nodes" in text
    assert "recent events" in text


def test_twelve_peers_wide_show_everything() -> None:
    text = draw(snapshot([peer(i) for i in range(12)]), 160, 60, events=events(12))
    assert all(name in text for name in NAMES) and "more" not in text
    assert text.count("peer_joined") == 10  # only the last ten events


def test_split_bar_names_stages_and_layers() -> None:
    snap = snapshot([peer(0), peer(1)])
    snap["splits"] = [{"model": "qwen2-7b", "stages": [{"node_id": node_id("alpha"), "layers": [0, 9]},
                                                       {"node_id": node_id("beta"), "layers": [9, 28]}]}]
    for width in (80, 160):
        text = draw(snap, width, 24)
        bar = next(line for line in text.splitlines() if line.startswith("qwen2-7b"))
        assert "alpha 0-8" in bar and "beta 9-27" in bar
        assert bar.index("beta") > len(bar) // 4  # segments are proportional: alpha holds a third


def test_unreachable_header_and_events() -> None:
    evs = [{"ts": NOW - 5, "type": "peer_state", "node_id": node_id("beta"), "state": "suspect"},
           {"ts": NOW - 1, "type": "request_failed", "model": "m", "error": "stage gamma timed out"}]
    text = draw(snapshot([peer(0)]), 80, 24, events=evs, link=Link(API, reachable=False, last_ok=NOW - 7))
    assert "node unreachable, retrying" in text and "7s ago" in text
    assert "peer_state" in text and "beta state=suspect" in text and "request_failed" in text


def test_partial_snapshot_still_draws() -> None:
    text = draw({"node_id": node_id("alpha"), "peers": [{"node_id": node_id("beta")}]}, 80, 24)
    assert node_id("beta")[:8] in text


def test_formatters() -> None:
    assert [fmt_ms(x) for x in (0.8, 12.3, 340, 2100)] == ["0.8", "12", "340", "2.1s"]
    assert [fmt_duration(x) for x in (5, 185, 7500, 90000)] == ["5s", "3m05s", "2h05m", "1d01h"]
    assert fmt_capacity({"ram_bytes": 3 * 2**29, "vram_bytes": 0, "cpu_cores": 4}, wide=True) == "RAM 1.5 GiB · 4 cores"
    assert "rgb(40,190" in heat_style(0.5) and "rgb(240,20" in heat_style(500)  # green fast, red slow


def events(n: int) -> list[dict[str, Any]]:
    return [{"ts": NOW - n + i, "type": "peer_joined", "node_id": node_id(NAMES[i % 12])} for i in range(n)]


def test_demand_and_standby_section() -> None:
    snap = snapshot([peer(0)])
    assert "demand and standby" not in draw(snap, 80, 24)  # nothing asked for, no standby: no section
    snap["demand"] = [{"model": "llama-70b", "requests": 12, "unmet": 3, "last_active_age_s": 4.0, "origins": 2,
                       "served_by": []},
                      {"model": "gemma-3-270m", "requests": 5, "unmet": 0, "last_active_age_s": 1.0, "origins": 1,
                       "served_by": ["beta"]}]
    snap["standby"] = {"enabled": True, "candidates": ["gemma-3-270m", "qwen"], "serving": ["gemma-3-270m"],
                       "waiting": [{"model": "qwen", "reason": "queue", "for_s": 1.5}], "cooling": [],
                       "idle_s": 300.0, "decisions": [{"at": NOW, "model": "gemma-3-270m", "action": "promote",
                                                       "reason": "queue"}]}
    text = draw(snap, 160, 40, events=events(3))
    section = text[text.index("demand and standby"):text.index("recent events")]
    assert "standby on · library gemma-3-270m, qwen · serving gemma-3-270m" in section
    assert "qwen: queue for 1.5s" in section and "last: promote gemma-3-270m (queue)" in section
    assert "llama-70b  12 req/min  3 refused  served by nobody  last 4s ago" in section
    assert "gemma-3-270m  5 req/min  served by beta" in section
    assert "recent events" in draw(snap, 80, 24, events=events(12))  # still fits a small terminal
