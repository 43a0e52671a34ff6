// Live figures and the node's event feed.
//
// Rates come from successive /api/status snapshots (kept for the last few minutes, drawn as a
// sparkline); events come from /api/events, read with fetch() so the token can be sent, and the
// stream reconnects with a growing pause when it breaks.

import { el, fmtClock, replace, shortId, svg } from "./dom.js";
// NOISY (hidden unless asked for: every gossip heartbeat makes one) comes from the node's event types.
import { NOISY } from "./events.js";

const HISTORY = 180; // samples kept for the sparkline (about three minutes at one per second)
const MAX_EVENTS = 200; // kept in memory
const SHOWN = 60; // listed

/** Rolling rates from snapshots: requests per second at this node, tokens per second the mesh generates now. */
export class Rates {
  constructor() { this.samples = []; this.last = null; }

  /** Add a snapshot taken at `now` (ms); returns the figures to show. */
  add(status, nodes, now) {
    const total = status.requests?.total ?? 0;
    const dt = this.last ? (now - this.last.now) / 1000 : 0;
    const reqS = dt > 0 ? Math.max(0, (total - this.last.total) / dt) : 0;
    this.last = { now, total };
    // A node's tok_s is its recent decode speed; only nodes generating now add to the mesh's output.
    const tokS = nodes.reduce((sum, n) => sum + (n.load?.in_flight ? Number(n.load.tok_s) || 0 : 0), 0);
    const running = nodes.reduce((sum, n) => sum + (n.load?.in_flight || 0) + (n.load?.queue || 0), 0);
    this.samples.push({ now, reqS, tokS });
    if (this.samples.length > HISTORY) this.samples.shift();
    return {
      nodes: nodes.length, reqS, perMin: status.requests?.per_min ?? 0, tokS, running,
      total, failed: status.requests?.failed ?? 0,
    };
  }
}

export function renderRates(container, figures) {
  const item = (label, value, id) => el("div", { class: "stat" },
    el("dt", { text: label }), el("dd", { id, text: value }));
  replace(container,
    item("Nodes", String(figures.nodes), "stat-nodes"),
    item("Requests / min", figures.perMin.toFixed(0), "stat-per-min"),
    item("Requests / s", figures.reqS.toFixed(1), "stat-req-s"),
    item("Tokens / s now", figures.tokS.toFixed(0), "stat-tok-s"),
    item("In progress", String(figures.running), "stat-running"),
    item("Total (failed)", `${figures.total} (${figures.failed})`, "stat-total"));
}

/** Two sparklines (tokens/s and requests/s, each scaled to its own peak) over the kept samples. */
export function renderSpark(target, rates) {
  const w = 300, h = 56, s = rates.samples;
  const line = (key) => {
    const peak = Math.max(1e-9, ...s.map((p) => p[key]));
    const x = (i) => (i * w / (HISTORY - 1)).toFixed(1);
    const y = (v) => (h - 4 - (h - 8) * v / peak).toFixed(1);
    return s.map((p, i) => `${i ? "L" : "M"}${x(i)} ${y(p[key])}`).join(" ");
  };
  target.setAttribute("viewBox", `0 0 ${w} ${h}`);
  replace(target, s.length < 2 ? [] : [svg("path", { class: "spark-tok", d: line("tokS") }),
    svg("path", { class: "spark-req", d: line("reqS") })]);
}

/** A one-line description of a node event, naming nodes by name where the snapshot knows them. */
export function summarise(event, names) {
  const who = (id) => (id ? names.get(id) || (id === event.node_id && event.name) || shortId(id) : "?");
  switch (event.type) {
    case "peer_joined": return `${who(event.node_id)} joined`;
    case "peer_left": return `${who(event.node_id)} left (${event.reason}${event.accuser ? `, said ${who(event.accuser)}` : ""})`;
    case "peer_state": return `${who(event.node_id)} is ${event.state}`;
    case "peer_connected": return `connected to ${who(event.node_id)} (${event.path})`;
    case "peer_path": return `path to ${who(event.node_id)} is now ${event.path}`;
    case "record_updated": return `${who(event.node_id)} record #${event.seq}`;
    case "record_rejected": return `rejected gossip from ${who(event.source)}: ${event.error || event.reason}`;
    case "model_loading": return `loading ${event.model}`;
    case "model_ready": return `${event.model} ready (${event.load_s} s)`;
    case "request_failover": return `${event.model}: ${who(event.node_id)} failed (${event.status}), trying the next node`;
    case "ready": return `node ready at ${event.api_url}`;
    case "mesh_ready": return `joined ${event.mesh_id}`;
    case "split_ready": return `${event.model} split ready`;
    case "split_stage_failed": return `${event.model}: stage ${event.stage} on ${who(event.failed_node)} failed`;
    case "published": return `published as ${JSON.stringify(event.name)}`;
    case "unpublished": return `no longer published`;
    case "stopping": return "node stopping";
    default: {
      const rest = Object.entries(event).filter(([k]) => k !== "type" && k !== "ts")
        .map(([k, v]) => `${k}=${typeof v === "string" ? v : JSON.stringify(v)}`);
      return rest.join(" ");
    }
  }
}

/**
 * The events list: newest first, deduplicated (a reconnect replays the node's recent history).
 * New events are prepended to the list rather than redrawing it, so its live region announces
 * only what is new.
 */
export class EventLog {
  constructor(list, toggle) {
    this.list = list;
    this.toggle = toggle;
    this.events = [];
    this.seen = new Set();
    this.shown = [];
    this.names = new Map();
    toggle.addEventListener("change", () => { this.shown = []; this.render(this.names); });
  }

  /** Keep `event`; false when it was already seen. */
  add(event) {
    const key = JSON.stringify(event);
    if (this.seen.has(key)) return false;
    this.seen.add(key);
    this.events.push(event);
    if (this.events.length > MAX_EVENTS) this.seen.delete(JSON.stringify(this.events.shift()));
    return true;
  }

  item(e) {
    return el("li", { class: `event ev-${e.type}`, dataset: { type: e.type } },
      el("time", { text: fmtClock(e.ts) }), " ", el("span", { class: "ev-type", text: e.type }), " ",
      el("span", { class: "ev-text", text: summarise(e, this.names) }));
  }

  render(names) {
    this.names = names;
    const shown = this.events.filter((e) => this.toggle.checked || !NOISY.has(e.type)).slice(-SHOWN).reverse();
    const fresh = this.shown.length ? shown.indexOf(this.shown[0]) : -1;
    if (fresh >= 0 && shown.slice(fresh).every((e, i) => i >= this.shown.length || e === this.shown[i])) {
      if (fresh) this.list.prepend(...shown.slice(0, fresh).map((e) => this.item(e)));
      while (this.list.children.length > shown.length) this.list.lastElementChild.remove();
    } else {
      replace(this.list, shown.length ? shown.map((e) => this.item(e))
        : el("li", { class: "muted", text: "No events yet." }));
    }
    this.shown = shown;
  }
}

/**
 * Follows /api/events for as long as the page lives: `onEvent(event)` for each one, `onState(state,
 * error)` with "live", "reconnecting" or "unauthorized". A broken stream is retried after a pause
 * that doubles up to 10 s; `restart()` reconnects at once (e.g. with a new token).
 */
export class EventFeed {
  constructor(api, onEvent, onState) {
    Object.assign(this, { api, onEvent, onState, ctrl: null, wake: null, pause: 1000 });
  }

  restart() {
    this.pause = 1000;
    this.again = true;
    if (this.ctrl) this.ctrl.abort();
    if (this.wake) this.wake();
  }

  async run() {
    for (;;) {
      this.ctrl = new AbortController();
      try {
        await this.api.stream("/api/events", {
          signal: this.ctrl.signal,
          onOpen: () => { this.pause = 1000; this.onState("live"); },
          onEvent: ({ event, data }) => {
            try {
              const parsed = JSON.parse(data);
              if (parsed && typeof parsed === "object") this.onEvent({ ...parsed, type: parsed.type || event });
            } catch { /* one bad event never ends the feed */ }
          },
        });
        this.onState("reconnecting");
      } catch (err) {
        if (err.name !== "AbortError") this.onState(err.unauthorized ? "unauthorized" : "reconnecting", err);
      }
      if (this.again) { this.again = false; continue; }
      const pause = this.pause;
      this.pause = Math.min(10000, pause * 2);
      await new Promise((resolve) => { this.wake = resolve; setTimeout(resolve, pause); });
      this.wake = null;
    }
  }
}
