// The blackboard view: the mesh's notes, newest first, with a search box and a post box.
//
// Notes come from GET /api/blackboard (every member holds the same ones); posting goes through
// POST /api/blackboard, which the node scrubs, signs and spreads, and which needs its admin token or
// an API key. The feed refreshes every few seconds while the view is open and at once when the
// node reports a note (`note_posted`, `note_received`).

import { el, replace, setText, shortId } from "./dom.js";

const $ = (id) => document.getElementById(id);
const KINDS = ["STATUS", "QUESTION", "FINDING", "TIP", "DONE"];

/** The query string of a search: words (KIND: words pick the kind), a node, an age in hours. */
export function boardQuery(words, from, hours, limit = 50) {
  const params = new URLSearchParams({ limit: String(limit) });
  if (words.trim()) params.set("q", words.trim());
  if (from.trim()) params.set("from", from.trim());
  if (Number(hours) > 0) params.set("since_s", String(Number(hours) * 3600));
  return `/api/blackboard?${params}`;
}

/** "3m ago" style age of a note signed at `ts` (Unix seconds), seen at `now` (ms). */
export function age(ts, now = Date.now()) {
  const s = Math.max(0, now / 1000 - ts);
  for (const [unit, size] of [["d", 86400], ["h", 3600], ["m", 60]]) if (s >= size) return `${Math.floor(s / size)}${unit} ago`;
  return `${Math.floor(s)}s ago`;
}

function noteItem(note) {
  const who = note.name || shortId(note.author);
  const owner = note.owner ? el("span", { class: "muted", text: ` · owner ${shortId(note.owner)}` }) : "";
  const kind = KINDS.includes(note.kind) ? el("span", { class: `kind kind-${note.kind.toLowerCase()}`, text: note.kind }) : "";
  const text = note.kind ? note.text.replace(/^\s*[A-Za-z]+:\s*/, "") : note.text;
  return el("li", { class: "note" },
    el("div", { class: "note-head" }, kind, el("strong", { text: who, title: `node ${note.author}` }), owner,
      el("span", { class: "muted", text: ` · ${age(note.ts)}` })),
    el("p", { class: "note-text", text }));
}

export class Blackboard {
  constructor(api) {
    this.api = api;
    this.list = $("board-notes");
    this.state = $("board-state");
    $("board-search").addEventListener("submit", (e) => { e.preventDefault(); this.refresh(); });
    $("board-post").addEventListener("submit", (e) => { e.preventDefault(); this.post(); });
  }

  async refresh() {
    const path = boardQuery($("board-words").value, $("board-from").value, $("board-since").value);
    try {
      const notes = (await this.api.json(path, { timeoutMs: 5000 })).notes || [];
      replace(this.list, ...notes.map(noteItem));
      setText(this.state, notes.length ? `${notes.length} note${notes.length === 1 ? "" : "s"}` : "No notes match.");
    } catch (err) {
      setText(this.state, `Could not read the blackboard: ${err.message}`);
    }
  }

  async post() {
    const input = $("board-text");
    const text = `${$("board-kind").value}${input.value.trim()}`;
    if (!input.value.trim()) return;
    try {
      const note = await this.api.json("/api/blackboard", { method: "POST", body: { text } });
      input.value = "";
      setText($("board-result"), `Posted ${note.id.slice(0, 12)}${note.text !== text ? " (personal data scrubbed)" : ""}.`);
      this.refresh();
    } catch (err) {
      setText($("board-result"), err.unauthorized
        ? "Posting needs the node's admin token or an API key (enter it under Owner → Access)."
        : `Not posted: ${err.message}`);
    }
  }
}
