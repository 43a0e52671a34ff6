// The console page: polls the node's status, follows its events, and draws every view from them.
//
// /api/status is fetched every second (and at once when an event says a peer came, went or changed),
// /v1/models every five seconds; views redraw only from what the node answered, so nothing on the
// page is made up. A failing call shows in the header ("offline", "needs a token") and is retried.

import { Api, takeTokenFromFragment } from "./api.js";
import { Blackboard } from "./blackboard.js";
import { Chat } from "./chat.js";
import { Control, renderStandby } from "./control.js";
import { el, fmtDuration, meshNodes, nodeNames, replace, setText, shortId } from "./dom.js";
import { BOARD_ON, REFRESH_ON } from "./events.js"; // from the node's event types (meshllm/events.py)
import { EventFeed, EventLog, Rates, renderRates, renderSpark } from "./live.js";
import { renderMap, renderNodes } from "./map.js";
import { renderMatrix } from "./matrix.js";
import { renderModels, renderOptional, renderSplits } from "./models.js";
import { Owner } from "./owner.js";

const STATUS_EVERY_MS = 1000;
const MODELS_EVERY_MS = 5000;
const $ = (id) => document.getElementById(id);

takeTokenFromFragment(sessionStorage);
const api = new Api();
const state = { status: null, models: [], statusError: null, feed: "connecting", feedError: null };
const rates = new Rates();
const events = new EventLog($("events"), $("show-noisy"));
const chat = new Chat(api);
const board = new Blackboard(api);
const feed = new EventFeed(api, onEvent, (s, err) => { state.feed = s; state.feedError = err || null; showLink(); });
const owner = new Owner(api, () => { feed.restart(); refreshStatus(); refreshModels(); });
const control = new Control(api, () => { refreshStatus(); refreshModels(); });

// -- theme and tabs ---------------------------------------------------------------------------------

const THEMES = ["auto", "light", "dark"];
function applyTheme(theme) {
  if (theme === "auto") delete document.documentElement.dataset.theme;
  else document.documentElement.dataset.theme = theme;
  $("theme").textContent = `Theme: ${theme}`;
}
applyTheme(localStorage.getItem("meshllm.theme") || "auto");
$("theme").addEventListener("click", () => {
  const now = THEMES[(THEMES.indexOf(localStorage.getItem("meshllm.theme") || "auto") + 1) % THEMES.length];
  localStorage.setItem("meshllm.theme", now);
  applyTheme(now);
});

const tabs = [...document.querySelectorAll('[role="tab"]')];
function selectTab(tab, focus) {
  for (const t of tabs) {
    const on = t === tab;
    t.setAttribute("aria-selected", String(on));
    t.tabIndex = on ? 0 : -1;
    $(t.getAttribute("aria-controls")).hidden = !on;
  }
  if (focus) tab.focus();
  history.replaceState(null, "", `#${tab.id.slice(4)}`);
  render();
}
for (const tab of tabs) {
  tab.addEventListener("click", () => selectTab(tab, false));
  tab.addEventListener("keydown", (e) => {
    const i = tabs.indexOf(tab);
    const to = { ArrowRight: i + 1, ArrowLeft: i - 1, Home: 0, End: tabs.length - 1 }[e.key];
    if (to === undefined) return;
    e.preventDefault();
    selectTab(tabs[(to + tabs.length) % tabs.length], true);
  });
}
selectTab($(`tab-${location.hash.slice(1)}`) || tabs[0], false);
addEventListener("hashchange", () => { const t = $(`tab-${location.hash.slice(1)}`); if (t) selectTab(t, false); });

// -- the header -------------------------------------------------------------------------------------

function showLink() {
  const link = $("link");
  const err = state.statusError;
  let s = state.feed === "live" ? "live" : "polling", text = state.feed === "live" ? "live" : "events reconnecting";
  if (err && err.unauthorized) { s = "locked"; text = "needs a token"; }
  else if (err) { s = "offline"; text = "node not answering"; }
  else if (!state.status) { s = "connecting"; text = "connecting"; }
  link.dataset.state = s;
  setText(link, text);
  // The banner is an alert: redraw it only when what it says changes, or it is announced every second.
  const authErr = err && err.unauthorized ? err : state.feed === "unauthorized" ? state.feedError : null;
  const said = authErr ? `auth:${authErr.message}` : err ? `down:${err.message}` : "";
  const banner = $("banner");
  if (banner.dataset.said === said) return;
  banner.dataset.said = said;
  banner.hidden = !said;
  if (authErr) {
    replace(banner, `The node asks for a token: ${authErr.message}. `,
      el("a", { href: "#owner", text: "Enter its admin token or API key" }), ".");
  } else if (err) {
    replace(banner, `The node is not answering (${err.message}); retrying every second. `,
      "Is meshllm serve still running?");
  }
}

function showSummary(status) {
  const owned = status.mesh_owner ? " · mesh owner" : "";
  const passive = status.passive ? " · passive: routes from its anchors' tables" : "";
  $("summary").textContent = `${status.name} (${status.role}${passive}${owned}) · ${status.mesh_id} · v${status.version}`
    + ` · up ${fmtDuration(status.uptime_s)}`;
  $("summary").title = `node ${status.node_id}`;
  document.title = `${status.name} · meshllm console`;
}

// -- drawing ----------------------------------------------------------------------------------------

function render() {
  const status = state.status;
  if (!status) return;
  const nodes = meshNodes(status);
  const names = nodeNames(status);
  showSummary(status);
  if (!$("view-mesh").hidden) {
    renderMap($("map"), status, nodes);
    renderMatrix($("matrix"), nodes, status.rtt_matrix || {});
    renderNodes($("nodes"), nodes);
    const gone = (status.peers || []).filter((p) => !["alive", "suspect"].includes(p.state));
    $("gone").textContent = gone.length
      ? `Gone: ${gone.map((p) => `${p.name || shortId(p.node_id)} (${p.state})`).join(", ")}` : "";
    events.render(names);
  }
  if (!$("view-models").hidden) {
    renderModels($("models"), nodes, state.models);
    renderSplits($("splits"), status, nodes);
    renderOptional($("transfers-card"), $("transfers"), status.transfers);
    renderOptional($("demand-card"), $("demand"), status.demand);
    renderStandby($("standby-card"), $("standby"), status.standby);
  }
  owner.update(status);
  control.update(status);
}

// The blackboard is read when its view opens, every few seconds while it stays open, and on note events.
const BOARD_EVERY_MS = 5000;
setInterval(() => { if (!$("view-board").hidden) board.refresh(); }, BOARD_EVERY_MS);
$("tab-board").addEventListener("click", () => board.refresh());

// -- polling and events -----------------------------------------------------------------------------

let statusTimer = null;
async function refreshStatus() {
  clearTimeout(statusTimer);
  try {
    state.status = await api.json("/api/status", { timeoutMs: 5000 });
    state.statusError = null;
    const figures = rates.add(state.status, meshNodes(state.status), performance.now());
    renderRates($("rates"), figures);
    renderSpark($("spark"), rates);
    render();
  } catch (err) {
    state.statusError = err;
  }
  showLink();
  statusTimer = setTimeout(refreshStatus, STATUS_EVERY_MS);
}

let modelsTimer = null;
async function refreshModels() {
  clearTimeout(modelsTimer);
  try {
    state.models = (await api.json("/v1/models", { timeoutMs: 5000 })).data || [];
    chat.setModels(state.models);
    render();
  } catch { /* the status poll reports a node that is not answering */ }
  modelsTimer = setTimeout(refreshModels, MODELS_EVERY_MS);
}

let soon = null;
function onEvent(event) {
  if (BOARD_ON.has(event.type) && !$("view-board").hidden) board.refresh();
  if (!events.add(event)) return;
  if (!$("view-mesh").hidden) events.render(nodeNames(state.status));
  if (REFRESH_ON.has(event.type) && !soon) {
    soon = setTimeout(() => { soon = null; refreshStatus(); refreshModels(); }, 100);
  }
}

new ResizeObserver(() => {
  if (state.status && !$("view-mesh").hidden) renderMap($("map"), state.status, meshNodes(state.status));
}).observe($("map").parentElement);
refreshStatus();
refreshModels();
feed.run();
