// The RTT matrix as a heat map: one row and one column per node, the round trip from row to column.

import { el, fmtMs, replace } from "./dom.js";

// Green at or below LOW_MS, red at or above HIGH_MS, log-scaled in between (as `meshllm status`).
const LOW_MS = 1, HIGH_MS = 200;

/** 0 (near) to 1 (far) for an RTT in ms; the CSS turns it into a colour (`--level`). */
export function rttLevel(ms) {
  if (!(ms > LOW_MS)) return 0;
  return Math.min(1, Math.log(ms / LOW_MS) / Math.log(HIGH_MS / LOW_MS));
}

/** Draw `nodes` (from meshNodes) against `matrix` ({a: {b: ms}}) into `container`. */
export function renderMatrix(container, nodes, matrix) {
  if (nodes.length < 2) {
    replace(container, el("p", { class: "muted", text: "One node: no distances yet." }));
    return;
  }
  const head = el("tr", {}, el("th", { scope: "col" }, el("span", { class: "visually-hidden", text: "from \\ to" })),
    nodes.map((n) => el("th", { scope: "col", title: n.id, text: n.name })));
  const rows = nodes.map((from) => el("tr", {},
    el("th", { scope: "row", title: from.id, text: from.name }),
    nodes.map((to) => {
      if (from.id === to.id) return el("td", { class: "self", "aria-label": "same node" }, "—");
      const ms = matrix?.[from.id]?.[to.id];
      if (ms === undefined || ms === null) return el("td", { class: "unknown", title: "not measured" }, "?");
      const cell = el("td", { class: "heat", title: `${from.name} → ${to.name}: ${ms} ms`,
        dataset: { from: from.id, to: to.id } }, fmtMs(ms));
      cell.style.setProperty("--level", rttLevel(ms).toFixed(3));
      return cell;
    })));
  const table = el("table", { class: "matrix", id: "rtt-matrix" },
    el("caption", { text: "Round trip in ms, from the row's node to the column's" }),
    el("thead", {}, head), el("tbody", {}, rows));
  replace(container, table);
}
