// Models: where each one is served, split chains with each stage's node and layer range, and (when
// the node reports them) model transfers between nodes and the mesh's demand for models.

import { el, fmtBytes, fmtDuration, replace } from "./dom.js";

/** Group the models of `nodes` by name: whole servers, split coordinators and stage hosts. */
export function modelGroups(nodes, listed) {
  const groups = new Map();
  const group = (name) => {
    if (!groups.has(name)) groups.set(name, { name, context: null, servers: [], stages: [] });
    return groups.get(name);
  };
  // `auto` routes each request to one of the others (docs/api.md): the chat offers it, this table does not
  for (const entry of listed || []) if (entry.id !== "auto") group(entry.id).context = entry.context_length ?? null;
  for (const node of nodes) {
    for (const m of node.models) {
      const g = group(m.name);
      g.context = g.context ?? m.context;
      if (m.engine === "stage") g.stages.push({ node, layers: m.layers });
      else g.servers.push({ node, engine: m.engine, layers: m.engine === "split" ? m.layers : null });
    }
  }
  return [...groups.values()].sort((a, b) => a.name.localeCompare(b.name));
}

function chip(node, text) {
  return el("li", { class: `chip${node.self ? " self" : ""}`, dataset: { nodeId: node.id } },
    el("strong", { text: node.name }), text ? ` ${text}` : "",
    node.self ? el("span", { class: "muted", text: " (this node)" }) : "");
}

function range(layers) { return layers ? `[${layers[0]}–${layers[1]})` : ""; }

function servedBy(g) {
  const items = [
    ...g.servers.map((s) => chip(s.node, s.engine === "split" ? `· split coordinator ${range(s.layers)}`
      : `· ${s.engine}`)),
    ...g.stages.map((s) => chip(s.node, `· stage ${range(s.layers)}`)),
  ];
  return items.length ? el("ul", { class: "chips" }, items) : el("span", { class: "muted", text: "no live node" });
}

export function renderModels(container, nodes, listed) {
  const groups = modelGroups(nodes, listed);
  if (!groups.length) {
    replace(container, el("p", { class: "muted", text: "No model is served in this mesh yet." }));
    return;
  }
  replace(container, el("table", { class: "list", id: "models-table" },
    el("caption", { class: "visually-hidden", text: "Models and the nodes serving them" }),
    el("thead", {}, el("tr", {}, ["Model", "Context", "Served by"].map((h) => el("th", { scope: "col", text: h })))),
    el("tbody", {}, groups.map((g) => el("tr", { dataset: { model: g.name } },
      el("th", { scope: "row", text: g.name }), el("td", { text: g.context ? `${g.context} tokens` : "—" }),
      el("td", {}, servedBy(g)))))));
}

/** A stage's layer fetch while its chain is placed: a bar, bytes, rate and time left. */
function fetchView(name, f) {
  const p = progressOf(f);
  const eta = typeof f.eta_s === "number" && f.bytes_done < f.bytes_total ? ` · ${fmtDuration(f.eta_s)} left` : "";
  return el("span", { class: "stage-fetch" }, p === null ? "" : el("progress", { max: 1, value: p.toFixed(3),
    "aria-label": `${name} fetching its layers: ${(p * 100).toFixed(0)} %` }),
  el("span", { class: "muted",
    text: ` ${fmtBytes(f.bytes_done)} of ${fmtBytes(f.bytes_total)} · ${fmtBytes(f.rate_bytes_s || 0)}/s${eta}` }));
}

function chainView(model, stages, meta, placing = false) {
  return el("li", { class: "chain", dataset: { model } },
    el("p", {}, el("strong", { text: model }), meta ? el("span", { class: "muted", text: ` — ${meta}` }) : ""),
    el("ol", { class: "stages" }, stages.map((s, i) => el("li", { class: "stage" },
      el("span", { class: "stage-index", text: `stage ${i}` }), el("strong", { text: s.name }),
      el("span", { text: range(s.layers) }), placing && s.fetch ? fetchView(s.name, s.fetch) : ""))));
}

/** This node's own chains (from `splits`) and, as gossiped, chains other nodes coordinate. */
export function renderSplits(container, status, nodes) {
  const chains = [];
  for (const split of status.splits || []) {
    const predicted = split.predicted_ms_per_token ? `${split.predicted_ms_per_token} ms/token predicted` : "";
    const meta = [split.state, split.reason, predicted].filter(Boolean).join(" · ");
    chains.push(chainView(split.model, split.stages, `coordinated here · ${meta}`, split.state === "placing"));
  }
  for (const g of modelGroups(nodes, [])) {
    for (const coord of g.servers.filter((s) => s.engine === "split" && !s.node.self)) {
      const stages = [{ name: coord.node.name, layers: coord.layers },
        ...g.stages.map((s) => ({ name: s.node.name, layers: s.layers }))]
        .sort((a, b) => (a.layers?.[0] ?? 0) - (b.layers?.[0] ?? 0));
      chains.push(chainView(g.name, stages, `coordinated by ${coord.node.name} (from gossip)`));
    }
  }
  replace(container, chains.length ? el("ul", { class: "chains" }, chains)
    : el("p", { class: "muted", text: "No model is split over several nodes." }));
}

/** Progress of a transfer-like object, 0..1, from the fields a transfer report may carry; null if none. */
export function progressOf(t) {
  if (typeof t.progress === "number") return Math.max(0, Math.min(1, t.progress));
  for (const [done, total] of [["bytes_done", "bytes_total"], ["done_bytes", "total_bytes"], ["done", "total"]]) {
    if (typeof t[done] === "number" && t[total] > 0) return Math.max(0, Math.min(1, t[done] / t[total]));
  }
  return null;
}

function fieldText(key, value) {
  if (typeof value === "number" && /bytes/.test(key)) return fmtBytes(value);
  if (typeof value === "number" && /(^|_)(age|s|secs|seconds)$/.test(key)) return fmtDuration(value);
  return typeof value === "object" && value !== null ? JSON.stringify(value) : String(value);
}

function objectRows(items) {
  return el("ul", { class: "records" }, items.map((item) => {
    const p = progressOf(item);
    return el("li", {}, p === null ? null : el("progress", { max: 1, value: p.toFixed(3),
      "aria-label": `${item.model || "transfer"}: ${(p * 100).toFixed(0)} %` }),
    el("dl", { class: "fields" },
      Object.entries(item).map(([k, v]) => [el("dt", { text: k }), el("dd", { text: fieldText(k, v) })])));
  }));
}

/** `transfers` and `demand` from the snapshot, in their cards; a card stays hidden while its key is absent. */
export function renderOptional(card, body, value) {
  card.hidden = value === undefined || value === null;
  if (card.hidden) return;
  const items = Array.isArray(value) ? value
    : Object.entries(value).map(([model, v]) => (v && typeof v === "object" && !Array.isArray(v)
      ? { model, ...v } : { model, value: v }));
  replace(body, items.length ? objectRows(items) : el("p", { class: "muted", text: "None right now." }));
}
