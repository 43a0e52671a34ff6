"""Rendering of ``meshllm status``: a node's status snapshot and recent events to rich renderables.

Pure on purpose: no I/O and no clock of its own (the caller passes ``now`` and the terminal size),
so every layout is tested by rendering sample snapshots to a recording console. The snapshot comes
from another process and may lack fields; every read has a default so a partial snapshot still draws.

The layout fits the terminal it is given: sections are stacked (header, peers, RTT heat map, split
topology, demand and standby when the mesh has any, events) and, when the height is short, long
sections are cut with a "+N more" line, events first, so an 80x24 terminal stays readable.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from rich.console import Group, RenderableType
from rich.rule import Rule
from rich.table import Table
from rich.text import Text

from meshllm.events import NodeEvent

SHORT_ID = 8
MAX_EVENTS = 10
WIDE = 120  # from this width on, capacity is spelled out ("RAM 24 GiB · 2 cores")

STATE_STYLES = {"alive": "green", "suspect": "yellow", "down": "red", "left": "dim", "revoked": "red"}
PATH_STYLES = {"direct": "green", "punched": "cyan", "relayed": "yellow", "none": "red"}
NODE_COLOURS = ["blue", "magenta", "dark_green", "dark_orange3", "purple", "dark_cyan", "red3", "gold3"]

# RTT heat-map scale: green at or below LOW_MS, red at or above HIGH_MS, log-scaled in between.
LOW_MS, HIGH_MS = 1.0, 200.0


@dataclass(frozen=True)
class Link:
    """How the dashboard is connected to the node; shown in the header."""

    api: str
    """The node's API URL."""
    reachable: bool = True
    """Whether the last poll of ``/api/status`` succeeded."""
    events_live: bool = True
    """Whether the ``/api/events`` stream is connected."""
    last_ok: float | None = None
    """Unix time of the last good snapshot, to say how stale the shown data is."""


def short(node_id: str) -> str:
    """The first characters of a 52-character node id: enough to tell nodes apart on screen."""
    return node_id[:SHORT_ID]


def node_names(snapshot: Mapping[str, Any]) -> dict[str, str]:
    """Display name per node id (this node and its peers); the short id where a node has no name."""
    names = {str(snapshot.get("node_id", "")): str(snapshot.get("name") or short(str(snapshot.get("node_id", ""))))}
    for peer in snapshot.get("peers") or []:
        node_id = str(peer.get("node_id", ""))
        names[node_id] = str(peer.get("name") or short(node_id))
    return names


def fmt_duration(seconds: float) -> str:
    """Uptime as the two largest units: ``42s``, ``5m03s``, ``2h05m``, ``3d04h``."""
    s = max(0, int(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 86400}d{s % 86400 // 3600:02d}h"


def fmt_bytes(n: float) -> str:
    """Bytes in binary units without needless decimals: ``24 GiB``, ``1.5 GiB``, ``512 MiB``."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024:
            return f"{n:.0f} {unit}" if unit == "B" or n >= 10 or n == int(n) else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.0f} TiB" if n >= 10 else f"{n:.1f} TiB"


def fmt_ms(ms: float) -> str:
    """An RTT in at most four characters, so a heat-map cell stays narrow: 0.8, 12, 340, 2.1s."""
    if ms < 10:
        return f"{ms:.1f}"
    if ms < 1000:
        return f"{ms:.0f}"
    return f"{ms / 1000:.1f}s" if ms < 10_000 else f"{ms / 1000:.0f}s"


def fmt_capacity(capacity: Mapping[str, Any] | None, wide: bool) -> str:
    """Memory (VRAM too when present) and cores: spelled out when wide, ``24G+8G·4c`` when narrow."""
    if not capacity:
        return "—"
    ram, vram, cores = capacity.get("ram_bytes") or 0, capacity.get("vram_bytes") or 0, capacity.get("cpu_cores") or 0
    if wide:
        parts = [f"RAM {fmt_bytes(ram)}"] + ([f"VRAM {fmt_bytes(vram)}"] if vram else []) + [f"{cores} cores"]
        return " · ".join(parts)
    return f"{ram / 2**30:.0f}G" + (f"+{vram / 2**30:.0f}G" if vram else "") + f"·{cores}c"


def fmt_load(load: Mapping[str, Any] | None) -> str:
    """Requests running/queued and generation speed: ``2/0 31t/s``."""
    if not load:
        return "—"
    return f"{load.get('in_flight', 0)}/{load.get('queue', 0)} {float(load.get('tok_s') or 0):.0f}t/s"


def fmt_models(models: Sequence[Mapping[str, Any]] | None) -> str:
    """Model names, with the layer range where a node holds only part of a model."""
    out = []
    for model in models or []:
        name = str(model.get("name", "?"))
        layers, n_layers = model.get("layers"), model.get("n_layers")
        if layers and n_layers and (layers[0] != 0 or layers[1] != n_layers):
            name += f"[{layers[0]}:{layers[1]}]"
        out.append(name)
    return ", ".join(out) or "—"


def heat_style(ms: float) -> str:
    """Cell style for an RTT: green → yellow → red on a log scale between LOW_MS and HIGH_MS."""
    t = (math.log(max(ms, LOW_MS)) - math.log(LOW_MS)) / (math.log(HIGH_MS) - math.log(LOW_MS))
    t = min(1.0, t)
    if t < 0.5:
        r, g = int(40 + 400 * t), 190
    else:
        r, g = 240, int(190 - 340 * (t - 0.5))
    return f"black on rgb({r},{g},40)"


def render_header(snapshot: Mapping[str, Any], link: Link, now: float, width: int) -> RenderableType:
    """Who this node is, which mesh, how long up, request counters and the connection state."""
    node_id = str(snapshot.get("node_id", ""))
    requests = snapshot.get("requests") or {}
    top = Text()
    top.append("meshllm ", style="bold")
    top.append(str(snapshot.get("name") or short(node_id)), style="bold cyan")
    top.append(f" ({short(node_id)})", style="dim")
    passive = " (passive)" if snapshot.get("passive") else ""
    top.append(f"  {snapshot.get('mesh_id', '?')}  {snapshot.get('role', '?')}{passive}")
    top.append(f"  up {fmt_duration(float(snapshot.get('uptime_s') or 0))}")
    if width >= WIDE:
        top.append(f"  v{snapshot.get('version', '?')}", style="dim")
    bottom = Text()
    if link.reachable:
        bottom.append("● connected", style="bold green")
        if not link.events_live:
            bottom.append(" (events reconnecting)", style="yellow")
    else:
        bottom.append("✖ node unreachable, retrying", style="bold red")
        if link.last_ok is not None:
            bottom.append(f" (data from {fmt_duration(now - link.last_ok)} ago)", style="red")
    bottom.append(f"  {link.api}", style="dim")
    failed = int(requests.get("failed") or 0)
    bottom.append(f"  req {requests.get('total', 0)} total · ")
    bottom.append(f"{failed} failed", style="red" if failed else "")
    bottom.append(f" · {float(requests.get('per_min') or 0):.1f}/min")
    top.no_wrap = bottom.no_wrap = True
    top.overflow = bottom.overflow = "ellipsis"
    return Group(top, bottom)


def _section(title: str) -> Rule:
    return Rule(Text(title, style="bold"), align="left", style="dim")


def _more(n: int, what: str) -> Text:
    return Text(f"  +{n} more {what}", style="dim italic")


PEER_COLUMNS = ("name", "id", "state", "role", "models", "capacity", "path", "rtt ms", "load")


def peer_cells(peer: Mapping[str, Any], wide: bool) -> list[Text]:
    """One peer's row; down and left peers are dimmed so live ones stand out."""
    state, path, rtt_ms = str(peer.get("state", "?")), str(peer.get("path", "?")), peer.get("rtt_ms")
    dim = "dim" if state in ("down", "left", "revoked") else ""
    return [
        Text(str(peer.get("name") or "—"), style=dim or "cyan"),
        Text(short(str(peer.get("node_id", ""))), style="dim"),
        Text(state, style=STATE_STYLES.get(state, "")),
        Text(str(peer.get("role", "?")), style=dim),
        Text(fmt_models(peer.get("models")), style=dim),
        Text(fmt_capacity(peer.get("capacity"), wide), style=dim),
        Text(path, style=PATH_STYLES.get(path, "")),
        Text("?" if rtt_ms is None else fmt_ms(float(rtt_ms)), style=dim),
        Text(fmt_load(peer.get("load")), style=dim),
    ]


def render_peers(snapshot: Mapping[str, Any], width: int, max_rows: int | None) -> list[RenderableType]:
    """The peers table, sorted by name so rows do not jump around as states change.

    Column widths are computed here rather than left to rich: rich shrinks every column evenly
    when a table is too wide, which would cut "suspect" to "suspe…"; only models may shrink.
    """
    peers = sorted(snapshot.get("peers") or [], key=lambda p: (str(p.get("name", "")), str(p.get("node_id", ""))))
    out: list[RenderableType] = [_section(f"peers ({len(peers)})")]
    if not peers:
        out.append(Text("  no peers yet (invite one with `meshllm invite create`)", style="dim"))
        return out
    shown = peers if max_rows is None or len(peers) <= max_rows else peers[: max(0, max_rows - 1)]
    rows = [peer_cells(peer, width >= WIDE) for peer in shown]
    widths = [max(len(header), *(r[i].cell_len for r in rows)) for i, header in enumerate(PEER_COLUMNS)]
    widths[0] = min(widths[0], 12)
    models = PEER_COLUMNS.index("models")
    widths[models] = max(6, min(widths[models], width - (sum(widths) - widths[models]) - len(widths) + 1))
    table = Table(box=None, padding=(0, 1), pad_edge=False, collapse_padding=True, show_edge=False,
                  header_style="bold dim")
    for header, col_width in zip(PEER_COLUMNS, widths, strict=True):
        table.add_column(header, no_wrap=True, overflow="ellipsis", width=col_width,
                         justify="right" if header == "rtt ms" else "left")
    for cells in rows:
        table.add_row(*cells)
    out.append(table)
    if len(shown) < len(peers):
        out.append(_more(len(peers) - len(shown), "peers"))
    return out


def matrix_nodes(snapshot: Mapping[str, Any]) -> list[str]:
    """Rows and columns of the heat map: this node, its peers that have not left, then any other id."""
    nodes = [str(snapshot.get("node_id", ""))]
    for peer in sorted(snapshot.get("peers") or [], key=lambda p: (str(p.get("name", "")), str(p.get("node_id", "")))):
        if peer.get("state") != "left":
            nodes.append(str(peer.get("node_id", "")))
    for row, cols in (snapshot.get("rtt_matrix") or {}).items():
        for node in (row, *cols):
            if node not in nodes:
                nodes.append(node)
    return nodes


def rtt(matrix: Mapping[str, Mapping[str, Any]], a: str, b: str) -> float | None:
    """Measured RTT from ``a`` to ``b``; a round trip is the same both ways, so ``b → a`` fills a gap."""
    for x, y in ((a, b), (b, a)):
        value = (matrix.get(x) or {}).get(y)
        if value is not None:
            return float(value)
    return None


def render_matrix(snapshot: Mapping[str, Any], width: int, max_rows: int | None) -> list[RenderableType]:
    """The RTT matrix as a heat map; cells are ms, "·" on the diagonal, "?" where unmeasured."""
    names = node_names(snapshot)
    nodes = matrix_nodes(snapshot)
    out: list[RenderableType] = [_section("RTT matrix (ms)")]
    if len(nodes) < 2:
        out.append(Text("  nothing measured yet", style="dim"))
        return out
    label_w = min(12, max(len(names.get(n, short(n))) for n in nodes))
    cols = nodes
    cell_w = max(4, min(8, (width - label_w - 1) // len(cols) - 1))
    if (cell_w + 1) * len(cols) + label_w > width:  # too many for the width: keep the first ones
        cols = nodes[: max(1, (width - label_w) // (cell_w + 1))]
    matrix = snapshot.get("rtt_matrix") or {}
    table = Table(box=None, padding=(0, 1), pad_edge=False, collapse_padding=True, show_edge=False,
                  header_style="bold dim")
    table.add_column("", no_wrap=True, width=label_w, overflow="ellipsis")
    for col in cols:
        table.add_column(names.get(col, short(col))[:cell_w], no_wrap=True, width=cell_w, justify="center")
    cut = len(cols) < len(nodes) or (max_rows is not None and len(nodes) > max_rows)
    rows = nodes if not cut else nodes[: max(1, (len(nodes) if max_rows is None else max_rows) - 1)]
    for row in rows:
        cells: list[Text] = [Text(names.get(row, short(row)), style="bold")]
        for col in cols:
            if row == col:
                cells.append(Text("·", style="dim"))
                continue
            value = rtt(matrix, row, col)
            cells.append(Text("?", style="dim") if value is None else Text(fmt_ms(value), style=heat_style(value)))
        table.add_row(*cells)
    out.append(table)
    if cut:
        out.append(_more(len(nodes) - min(len(rows), len(cols)), "nodes (enlarge the terminal)"))
    return out


def split_bar(split: Mapping[str, Any], names: Mapping[str, str], colours: Mapping[str, str],
              width: int) -> Text:
    """One model's chain as a bar: a segment per stage, as wide as its share of the layers."""
    stages = [s for s in split.get("stages") or [] if len(s.get("layers") or []) == 2]
    total = max((int(s["layers"][1]) for s in stages), default=0)
    bar = Text(no_wrap=True, overflow="crop")
    if total <= 0 or width <= 0:
        return bar
    used = 0
    for i, stage in enumerate(stages):
        start, end = int(stage["layers"][0]), int(stage["layers"][1])
        seg = width - used if i == len(stages) - 1 else max(1, round(width * (end - start) / total))
        seg = max(0, min(seg, width - used))
        node = str(stage.get("node_id", ""))
        label = f"{names.get(node, short(node))} {start}-{end - 1}"
        if len(label) > seg:
            label = label[:seg]
        bar.append(label.center(seg), style=f"bold white on {colours.get(node, 'grey37')}")
        used += seg
    return bar


def active_transfers(snapshot: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    """Model transfers still running (``/api/status`` ``transfers``)."""
    return [t for t in snapshot.get("transfers") or [] if t.get("state") in ("fetching", "verifying")]


def progress_text(progress: Mapping[str, Any]) -> str:
    """``42%  10.5/25.0 MB  3.1 MB/s  ETA 5s`` of a transfer or a stage's fetch."""
    done, total = int(progress.get("bytes_done") or 0), int(progress.get("bytes_total") or 0)
    text = f"{100 * done / total:3.0f}%  " if total else "  ?%  "
    text += f"{fmt_bytes(done)}/{fmt_bytes(total)}  {fmt_bytes(progress.get('rate_bytes_s') or 0)}/s"
    eta = progress.get("eta_s")
    if eta is not None and done < total:
        text += f"  ETA {fmt_duration(float(eta))}"
    return text


def transfer_line(transfer: Mapping[str, Any], width: int) -> Text:
    """``<- model layers a-b  42%  10.5/25.0 MB  3.1 MB/s  ETA 5s  from coord, h1``: one model transfer in flight."""
    layers = transfer.get("layers")
    what = f"layers {layers[0]}-{layers[1]}" if layers else str(transfer.get("kind", "whole"))
    holders = [h.get("name", "?") for h in transfer.get("holders") or [] if not h.get("dropped")]
    line = Text(no_wrap=True, overflow="ellipsis")
    line.append("  <- ", style="cyan")
    line.append(f"{transfer.get('model', '?')} {what}  ", style="bold")
    line.append(progress_text(transfer))
    if holders:
        line.append(f"  from {', '.join(holders)}", style="dim")
    line.truncate(width)
    return line


def stage_fetch_line(stage: Mapping[str, Any], names: Mapping[str, str], width: int) -> Text:
    """``stage w1 2-3  42%  10.5/25.0 MB  3.1 MB/s  ETA 5s``: a stage of a chain being placed, fetching its layers."""
    node = str(stage.get("node_id", ""))
    layers = stage.get("layers") or [0, 0]
    line = Text(no_wrap=True, overflow="ellipsis")
    line.append("   stage ", style="dim")
    line.append(f"{names.get(node, stage.get('name') or short(node))} {layers[0]}-{layers[1] - 1}  ", style="bold")
    line.append(progress_text(stage["fetch"]))
    line.truncate(width)
    return line


def render_splits(snapshot: Mapping[str, Any], width: int, max_rows: int | None) -> list[RenderableType]:
    """Split topology: one bar per model served by a chain of nodes, stages labelled name + layers;
    then one line per model transfer in flight (a worker fetching its layers, a node fetching a model)."""
    splits = snapshot.get("splits") or []
    transfers = active_transfers(snapshot)
    out: list[RenderableType] = [_section("split topology")]
    if not splits and not transfers:
        out.append(Text("  no splits", style="dim"))
        return out
    names = node_names(snapshot)
    colours = {node: NODE_COLOURS[i % len(NODE_COLOURS)] for i, node in enumerate(names)}
    label_w = min(20, max((len(str(s.get("model", "?"))) for s in splits), default=0))
    rows: list[RenderableType] = []
    for split in splits:
        line = Text(no_wrap=True, overflow="ellipsis")
        line.append(f"{str(split.get('model', '?'))[:label_w]:<{label_w}} ", style="bold")
        line.append_text(split_bar(split, names, colours, width - label_w - 1))
        rows.append(line)
        if split.get("state") == "placing":
            rows += [stage_fetch_line(stage, names, width) for stage in split.get("stages") or [] if stage.get("fetch")]
    rows += [transfer_line(t, width) for t in transfers]
    shown = rows if max_rows is None or len(rows) <= max_rows else rows[: max(0, max_rows - 1)]
    out += shown
    if len(shown) < len(rows):
        out.append(_more(len(rows) - len(shown), "splits and transfers"))
    return out


def demand_rows(snapshot: Mapping[str, Any]) -> int:
    """Lines of the demand section (0: the section is not shown)."""
    return len(snapshot.get("demand") or []) + (1 if snapshot.get("standby") else 0)


def demand_line(entry: Mapping[str, Any], width: int) -> Text:
    """``model  12 req/min  3 refused  served by a, b  last 4s ago``: the mesh's demand for one model."""
    line = Text(no_wrap=True, overflow="ellipsis")
    line.append(f"  {entry.get('model', '?')}  ", style="bold")
    line.append(f"{entry.get('requests', 0)} req/min")
    if entry.get("unmet"):
        line.append(f"  {entry['unmet']} refused", style="red")
    servers = entry.get("served_by") or []
    line.append(f"  served by {', '.join(servers)}" if servers else "  served by nobody",
                style="dim" if servers else "yellow")
    line.append(f"  last {fmt_duration(float(entry.get('last_active_age_s') or 0))} ago", style="dim")
    line.truncate(width)
    return line


def standby_line(standby: Mapping[str, Any], width: int) -> Text:
    """``standby on · library a, b · serving a · waiting b: queue 1.5s · cooling c``: this node's standby state."""
    line = Text(no_wrap=True, overflow="ellipsis")
    line.append("  standby ", style="bold")
    line.append("on" if standby.get("enabled") else "paused", style="green" if standby.get("enabled") else "yellow")
    line.append(f" · library {', '.join(standby.get('candidates') or []) or '-'}")
    line.append(f" · serving {', '.join(standby.get('serving') or []) or 'nothing'}")
    for wait in standby.get("waiting") or []:
        line.append(f" · {wait.get('model')}: {wait.get('reason')} for {wait.get('for_s')}s", style="yellow")
    if standby.get("cooling"):
        line.append(f" · cooling {', '.join(standby['cooling'])}", style="dim")
    decisions = standby.get("decisions") or []
    if decisions:
        last = decisions[-1]
        line.append(f" · last: {last.get('action')} {last.get('model')} ({last.get('reason')})", style="dim")
    line.truncate(width)
    return line


def render_demand(snapshot: Mapping[str, Any], width: int, max_rows: int | None) -> list[RenderableType]:
    """Demand per model (what clients asked for that their own node does not serve) and this node's standby."""
    if not demand_rows(snapshot):
        return []
    rows: list[RenderableType] = []
    if snapshot.get("standby"):
        rows.append(standby_line(snapshot["standby"], width))
    rows += [demand_line(entry, width) for entry in snapshot.get("demand") or []]
    shown = rows if max_rows is None or len(rows) <= max_rows else rows[: max(0, max_rows - 1)]
    out: list[RenderableType] = [_section("demand and standby"), *shown]
    if len(shown) < len(rows):
        out.append(_more(len(rows) - len(shown), "models asked for"))
    return out


def describe_event(event: NodeEvent, names: Mapping[str, str]) -> str:
    """The fields of an event beyond type and time, node ids replaced by names."""
    parts = []
    fields = event.details()
    node = fields.get("node_id")
    if node:
        parts.append(names.get(str(node), short(str(node))))
    for key, value in fields.items():
        if key == "node_id" or (key == "name" and node):
            continue
        text = names.get(value, short(value)) if isinstance(value, str) and len(value) == 52 else str(value)
        parts.append(f"{key}={text}")
    return " ".join(parts)


def render_events(events: Sequence[NodeEvent], snapshot: Mapping[str, Any],
                  max_rows: int | None) -> list[RenderableType]:
    """The latest events, newest last (like a log), cut to the rows there are."""
    out: list[RenderableType] = [_section("recent events")]
    limit = MAX_EVENTS if max_rows is None else max(0, min(MAX_EVENTS, max_rows))
    recent = list(events)[-limit:] if limit else []
    if not recent:
        out.append(Text("  no events yet", style="dim"))
        return out
    names = node_names(snapshot)
    for event in recent:
        line = Text(no_wrap=True, overflow="ellipsis")
        line.append(time.strftime("%H:%M:%S ", time.localtime(float(event.ts))), style="dim")
        line.append(f"{event.type:<14} ", style=event.style)
        line.append(describe_event(event, names))
        out.append(line)
    return out


def _table_rows(snapshot: Mapping[str, Any]) -> tuple[int, int, int]:
    peers = len(snapshot.get("peers") or [])
    nodes = len(matrix_nodes(snapshot))
    splits = snapshot.get("splits") or []
    fetching = sum(1 for s in splits if s.get("state") == "placing" for st in s.get("stages") or [] if st.get("fetch"))
    return peers, nodes if nodes >= 2 else 0, len(splits) + fetching + len(active_transfers(snapshot))


def fit(height: int | None, snapshot: Mapping[str, Any], n_events: int) -> tuple[int | None, ...]:
    """Rows for peers, matrix, splits, demand and events so the whole screen fits ``height`` lines.

    Fixed cost: two header lines, a title per section and a column-header line per table. What is
    left goes to peers first, then the matrix, splits, demand and events (events are the first to
    shrink). The demand section costs nothing while the snapshot has no demand and no standby.
    """
    if height is None:
        return None, None, None, None, None
    peers, nodes, splits = _table_rows(snapshot)
    demand = demand_rows(snapshot)
    fixed = 2 + 4 + (1 if peers else 0) + (1 if nodes else 0) + (1 if demand else 0)
    left = max(0, height - fixed)
    wants = [max(1, peers), max(1, nodes), max(1, splits), demand, max(1, min(MAX_EVENTS, n_events))]
    floors = [min(w, 3) for w in wants[:3]] + [min(demand, 2), min(wants[4], 2)]
    rows = floors[:]
    left -= sum(floors)
    for i, want in enumerate(wants):  # top-up in priority order
        extra = max(0, min(want - rows[i], left))
        rows[i] += extra
        left -= extra
    return tuple(rows)


def render(snapshot: Mapping[str, Any], events: Sequence[NodeEvent], link: Link, *,
           now: float, width: int, height: int | None = None) -> RenderableType:
    """The whole dashboard at unix time ``now`` for ``width`` x ``height`` (height None: no limit)."""
    peer_rows, matrix_rows, split_rows, demand_rows_, event_rows = fit(height, snapshot, len(events))
    return Group(
        render_header(snapshot, link, now, width),
        *render_peers(snapshot, width, peer_rows),
        *render_matrix(snapshot, width, matrix_rows),
        *render_splits(snapshot, width, split_rows),
        *render_demand(snapshot, width, demand_rows_),
        *render_events(events, snapshot, event_rows),
    )
