// Small DOM builders and formatters shared by every view.
//
// Names, models and every other string in a snapshot come from peers' records: they are only ever
// put in the page as text nodes or attribute values, never parsed as HTML.

const SVG_NS = "http://www.w3.org/2000/svg";

function build(node, attrs, children) {
  for (const [key, value] of Object.entries(attrs || {})) {
    if (value === null || value === undefined || value === false) continue;
    if (key === "class") node.setAttribute("class", value);
    else if (key === "text") node.textContent = value;
    else if (key === "dataset") Object.assign(node.dataset, value);
    else if (key.startsWith("on") && typeof value === "function") node.addEventListener(key.slice(2), value);
    else node.setAttribute(key, value === true ? "" : String(value));
  }
  for (const child of children.flat(Infinity)) {
    if (child === null || child === undefined || child === false) continue;
    node.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return node;
}

/** `el("p", {class: "x"}, "text", child)`: an HTML element. */
export const el = (tag, attrs, ...children) => build(document.createElement(tag), attrs, children);

/** The same for SVG elements. */
export const svg = (tag, attrs, ...children) => build(document.createElementNS(SVG_NS, tag), attrs, children);

/**
 * Replace the children of `node`. Views redraw every second, so an element the keyboard is on keeps
 * the focus when its replacement carries the same `data-focus-key`.
 */
export function replace(node, ...children) {
  const active = document.activeElement;
  const key = active && node.contains(active) ? active.dataset?.focusKey : undefined;
  node.replaceChildren();
  build(node, {}, children);
  if (key !== undefined) node.querySelector(`[data-focus-key="${CSS.escape(key)}"]`)?.focus();
}

/** Set `node`'s text only when it changes: live regions then announce changes, not every redraw. */
export function setText(node, text) {
  if (node.textContent !== text) node.textContent = text;
}

export const shortId = (id) => String(id || "").slice(0, 8);

export function fmtBytes(n) {
  let v = Number(n) || 0;
  for (const unit of ["B", "KiB", "MiB", "GiB", "TiB"]) {
    if (v < 1024 || unit === "TiB") return unit === "B" || v >= 10 ? `${v.toFixed(0)} ${unit}` : `${v.toFixed(1)} ${unit}`;
    v /= 1024;
  }
  return "";
}

export function fmtMs(ms) {
  if (ms === null || ms === undefined) return "—";
  if (ms < 10) return ms.toFixed(1);
  if (ms < 1000) return ms.toFixed(0);
  return `${(ms / 1000).toFixed(1)}s`;
}

/** An RTT with its unit: "0.8 ms", "12 ms", "2.1 s"; "—" when not measured. */
export function fmtRtt(ms) {
  if (ms === null || ms === undefined) return "—";
  return ms < 1000 ? `${fmtMs(ms)} ms` : `${(ms / 1000).toFixed(1)} s`;
}

export function fmtDuration(seconds) {
  const s = Math.max(0, Math.floor(seconds || 0));
  if (s < 60) return `${s}s`;
  if (s < 3600) return `${Math.floor(s / 60)}m${String(s % 60).padStart(2, "0")}s`;
  if (s < 86400) return `${Math.floor(s / 3600)}h${String(Math.floor(s % 3600 / 60)).padStart(2, "0")}m`;
  return `${Math.floor(s / 86400)}d${String(Math.floor(s % 86400 / 3600)).padStart(2, "0")}h`;
}

export const fmtClock = (ts) => new Date(ts * 1000).toLocaleTimeString([], { hour12: false });

export function fmtCapacity(c) {
  if (!c) return "—";
  const parts = [`${fmtBytes(c.ram_bytes)} RAM`];
  if (c.vram_bytes) parts.push(`${fmtBytes(c.vram_bytes)} VRAM`);
  parts.push(`${c.cpu_cores || 0} cores`);
  return parts.join(" · ");
}

export function fmtLoad(l) {
  if (!l) return "—";
  const slots = l.slots ? ` · ${l.free_slots || 0}/${l.slots} slots free` : "";
  return `${l.in_flight || 0} running · ${l.queue || 0} queued · ${(Number(l.tok_s) || 0).toFixed(0)} tok/s${slots}`;
}

/** "tiny", or "tiny [0–6)" for a layer range. */
export function fmtModel(m) {
  return m.layers ? `${m.name} [${m.layers[0]}–${m.layers[1]})` : m.name;
}

/** States in which a member is still drawn: alive, or suspect (missed probes, not yet declared down). */
export const SHOWN_STATES = new Set(["alive", "suspect"]);

/**
 * The nodes of a snapshot in one shape, this node first: the members still alive or suspect.
 * Down, departed and revoked members are left out (they leave the map when the node drops them).
 */
export function meshNodes(status) {
  if (!status) return [];
  const self = {
    id: status.node_id, name: status.name || shortId(status.node_id), role: status.role, state: "alive",
    self: true, models: status.models || [], capacity: status.capacity, load: status.load, path: null, rtt_ms: null,
  };
  const peers = (status.peers || []).filter((p) => SHOWN_STATES.has(p.state)).map((p) => ({
    id: p.node_id, name: p.name || shortId(p.node_id), role: p.role, state: p.state, self: false,
    models: p.models || [], capacity: p.capacity, load: p.load, path: p.path, rtt_ms: p.rtt_ms,
  }));
  return [self, ...peers];
}

/** Node id to display name, for every node a snapshot mentions (down ones too). */
export function nodeNames(status) {
  const names = new Map();
  if (!status) return names;
  names.set(status.node_id, status.name || shortId(status.node_id));
  for (const p of status.peers || []) names.set(p.node_id, p.name || shortId(p.node_id));
  return names;
}
