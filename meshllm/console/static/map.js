// The mesh as a map: nodes on a ring with their role, models, capacity and load; links coloured by
// path type (direct, punched, relayed) and labelled with their RTT on the heat-map colour scale.

import { el, fmtBytes, fmtCapacity, fmtLoad, fmtModel, fmtRtt, replace, svg } from "./dom.js";
import { rttLevel } from "./matrix.js";

const DETAIL_LIMIT = 8; // beyond this many nodes, only names are drawn (the table has the rest)
const NARROW = 560; // below this width (phones), one line under each name
const RADIUS = 22;

/** Label lines under each node: full details, the role only, or none. */
function detailLines(count, width) {
  return count > DETAIL_LIMIT ? 0 : width < NARROW ? 1 : 4;
}

/** Where `count` nodes go in a `width` x `height` box: a ring from the top (two nodes side by side). */
export function layout(count, width, height) {
  const lines = detailLines(count, width);
  const top = 44, bottom = height - 34 - 14 * lines, side = lines === 4 ? 92 : 56;
  const cx = width / 2, cy = (top + bottom) / 2;
  if (count === 1) return [{ x: cx, y: cy }];
  const rx = Math.max(20, width / 2 - side), ry = Math.max(20, (bottom - top) / 2);
  const start = count === 2 ? Math.PI : -Math.PI / 2;
  return Array.from({ length: count }, (_, i) => {
    const a = start + (2 * Math.PI * i) / count;
    return { x: cx + rx * Math.cos(a), y: cy + ry * Math.sin(a) };
  });
}

/** Links between shown nodes: the snapshot's `links`, else (an older node) this node's own peers. */
function linksOf(status, nodes) {
  const shown = new Set(nodes.map((n) => n.id));
  const links = status.links || nodes.filter((n) => !n.self && n.path && n.path !== "none")
    .map((n) => ({ a: status.node_id, b: n.id, rtt_ms: n.rtt_ms, path: n.path }));
  return links.filter((l) => shown.has(l.a) && shown.has(l.b));
}

function describe(node) {
  const models = node.models.map(fmtModel).join(", ") || "no models";
  const cap = node.capacity ? `${fmtBytes(node.capacity.ram_bytes)} RAM, ${node.capacity.cpu_cores || 0} cores` : "";
  const load = node.load ? `${node.load.in_flight || 0} running, ${Number(node.load.tok_s || 0).toFixed(0)} tok/s` : "";
  return [`${node.name}${node.self ? " (this node)" : ""}`, node.role, node.state !== "alive" ? node.state : "",
    models, cap, load].filter(Boolean).join("; ");
}

/** "idle" or "2 running · 1 queued", and the node's recent decode speed once it has one. */
function loadLine(load) {
  const busy = load.in_flight || load.queue ? `${load.in_flight || 0} running · ${load.queue || 0} queued` : "idle";
  return load.tok_s ? `${busy} · ${Number(load.tok_s).toFixed(0)} tok/s` : busy;
}

function drawNode(node, at, lines) {
  const detail = [
    `${node.role}${node.self ? " · this node" : ""}${node.state !== "alive" ? ` · ${node.state}` : ""}`,
    node.models.map(fmtModel).join(", ") || "no models",
    node.capacity ? `${fmtBytes(node.capacity.ram_bytes)} · ${node.capacity.cpu_cores || 0} cores` : "",
    node.load ? loadLine(node.load) : "",
  ].filter(Boolean).slice(0, lines);
  const label = describe(node);
  return svg("g", {
    class: `node role-${node.role} state-${node.state}${node.self ? " self" : ""}`, tabindex: 0, role: "img",
    "aria-label": label, transform: `translate(${at.x.toFixed(1)} ${at.y.toFixed(1)})`,
    dataset: { nodeId: node.id, state: node.state, focusKey: `node-${node.id}` },
  },
  svg("title", { text: label }),
  node.self ? svg("circle", { class: "halo", r: RADIUS + 6 }) : null,
  svg("circle", { class: "disc", r: RADIUS }),
  svg("text", { class: "initial", "text-anchor": "middle", dy: "0.35em", text: node.role.slice(0, 1).toUpperCase() }),
  svg("text", { class: "name", "text-anchor": "middle", y: RADIUS + 17, text: node.name }),
  detail.map((line, i) => svg("text", { class: "detail", "text-anchor": "middle", y: RADIUS + 33 + 14 * i, text: line })));
}

function drawLink(link, a, b, names) {
  const mx = (a.x + b.x) / 2, my = (a.y + b.y) / 2;
  const measured = link.rtt_ms !== null && link.rtt_ms !== undefined;
  const text = measured ? fmtRtt(link.rtt_ms) : "?";
  const badge = svg("rect", { x: -24, y: -10, width: 48, height: 20, rx: 10, class: measured ? "heat" : null });
  if (measured) badge.style.setProperty("--level", rttLevel(link.rtt_ms).toFixed(3));
  return svg("g", { class: "link", dataset: { a: link.a, b: link.b, path: link.path } },
    svg("title", { text: `${names.get(link.a)} ↔ ${names.get(link.b)}: ${link.path}, ${text}` }),
    svg("line", { class: `path-${link.path}`, x1: a.x, y1: a.y, x2: b.x, y2: b.y }),
    svg("g", { class: "rtt-badge", transform: `translate(${mx.toFixed(1)} ${my.toFixed(1)})` }, badge,
      svg("text", { "text-anchor": "middle", dy: "0.35em", text })));
}

/** Draw the map of `nodes` (from meshNodes, this node first) into the `<svg>` element. */
export function renderMap(el, status, nodes) {
  const width = Math.max(280, Math.round(el.parentElement.clientWidth));
  const height = Math.round(width < NARROW ? width * 1.05 : Math.min(520, Math.max(360, width * 0.6)));
  el.setAttribute("viewBox", `0 0 ${width} ${height}`);
  el.setAttribute("height", height);
  const spots = layout(nodes.length, width, height);
  const at = new Map(nodes.map((n, i) => [n.id, spots[i]]));
  const names = new Map(nodes.map((n) => [n.id, n.name]));
  const links = linksOf(status, nodes);
  replace(el,
    svg("title", { text: "Mesh map" }),
    svg("desc", { text: `${nodes.length} nodes and ${links.length} links. ${nodes.map(describe).join(". ")}` }),
    svg("g", { class: "links" }, links.map((l) => drawLink(l, at.get(l.a), at.get(l.b), names))),
    svg("g", { class: "nodes" }, nodes.map((n) => drawNode(n, at.get(n.id), detailLines(nodes.length, width)))));
}

/** The same nodes as a table, for the details the map has no room for (and for screen readers). */
export function renderNodes(container, nodes) {
  const cols = ["Node", "State", "Role", "Path", "RTT", "Models", "Capacity", "Load"];
  replace(container, el("table", { class: "list", id: "nodes-table" },
    el("caption", { class: "visually-hidden", text: "Nodes of the mesh; path and RTT are from this node" }),
    el("thead", {}, el("tr", {}, cols.map((c) => el("th", { scope: "col", text: c })))),
    el("tbody", {}, nodes.map((n) => el("tr", { dataset: { nodeId: n.id }, class: `state-${n.state}` },
      el("th", { scope: "row", title: n.id }, n.name, n.self ? el("span", { class: "muted", text: " (this node)" }) : ""),
      el("td", { class: "nowrap" }, el("span", { class: `dot ${n.state}`, "aria-hidden": "true" }), n.state),
      el("td", { text: n.role }),
      el("td", { text: n.self ? "—" : n.path }),
      el("td", { text: n.self ? "—" : fmtRtt(n.rtt_ms) }),
      el("td", { text: n.models.map(fmtModel).join(", ") || "—" }),
      el("td", { text: fmtCapacity(n.capacity) }),
      el("td", { text: fmtLoad(n.load) }))))));
}
