// Owner control in the console: load, unload and drain models on any node, and the standby node's decisions.
//
// On this node the admin token is enough (/api/models/load and /api/models/unload). Another node
// obeys only commands signed by its owner's key, so the page sends them to /api/owner/command with
// the passphrase of the owner keystore in this node's home; the node signs, forgets the key and
// returns the target's checked answer. The passphrase is read from its field for each command and
// never stored.

import { el, replace, setText, shortId } from "./dom.js";

const $ = (id) => document.getElementById(id);
const BUTTONS = ["control-load", "control-unload", "control-drain", "control-status"];
const TIMEOUT_S = 120;

/** Why commands to `nodeId` are unavailable now, or "" when they are available. */
export function controlGate(status, hasToken, nodeId) {
  if (!status) return "Waiting for the node's status.";
  if (!hasToken) return "Read-only: enter the node's admin token or API key under Access.";
  if (nodeId && nodeId !== status.node_id && !status.owner_key) {
    return "Commands to other nodes are signed with the owner key, and this node's home has no owner keystore "
      + "(meshllm auth init). Open the console of the node you administer from.";
  }
  return "";
}

/** What one answer says, in one line: the node's message, or why it refused. */
export function describeAnswer(op, answer) {
  if ("ok" in answer) {
    return answer.ok ? answer.message : `refused (${answer.code}): ${answer.message}`;
  }
  if (op === "load") return answer.loaded ? `loaded ${answer.model} (context ${answer.context})` : `${answer.model} was already served`;
  if (op === "unload") {
    return answer.drained ? `unloaded ${answer.model} after its requests finished (${answer.waited_s} s)`
      : `unloaded ${answer.model}; ${answer.cancelled} requests still running were cancelled`;
  }
  return JSON.stringify(answer);
}

export class Control {
  constructor(api, onChange) {
    this.api = api;
    this.onChange = onChange;
    this.status = null;
    this.note = $("control-note");
    this.result = $("control-result");
    $("control-form").addEventListener("submit", (e) => { e.preventDefault(); this.run("load"); });
    $("control-unload").addEventListener("click", () => this.run("unload"));
    $("control-drain").addEventListener("click", () => this.run("drain"));
    $("control-status").addEventListener("click", () => this.run("status"));
    $("control-node").addEventListener("change", () => this.gate());
  }

  /** A new snapshot: the node list (keeping the choice), the models they serve, the gate. */
  update(status) {
    this.status = status;
    const select = $("control-node");
    const chosen = select.value || status.node_id;
    const nodes = [{ node_id: status.node_id, name: `${status.name} (this node)`, models: status.models || [] },
      ...(status.peers || []).filter((p) => p.state === "alive" || p.state === "suspect")];
    const key = nodes.map((n) => `${n.node_id}:${n.name}`).join(",");
    if (select.dataset.key !== key) {
      select.dataset.key = key;
      replace(select, nodes.map((n) => el("option", { value: n.node_id, text: n.name || shortId(n.node_id) })));
      select.value = nodes.some((n) => n.node_id === chosen) ? chosen : status.node_id;
    }
    const served = [...new Set(nodes.flatMap((n) => (n.models || []).map((m) => m.name)))].sort();
    const list = $("control-models");
    if (list.dataset.key !== served.join(",")) {
      list.dataset.key = served.join(",");
      replace(list, served.map((m) => el("option", { value: m })));
    }
    $("control-passphrase").disabled = select.value === status.node_id;
    this.gate();
  }

  gate() {
    const reason = controlGate(this.status, Boolean(this.api.token), $("control-node").value);
    setText(this.note, reason);
    this.note.hidden = !reason;
    for (const id of BUTTONS) $(id).disabled = Boolean(reason);
    if (this.status) $("control-passphrase").disabled = $("control-node").value === this.status.node_id;
  }

  show(message, ok) {
    this.result.textContent = message;
    this.result.className = ok ? "result ok" : "result bad";
  }

  async run(op) {
    const node = $("control-node").value;
    const model = $("control-model").value.trim();
    if ((op === "load" || op === "unload") && !model) { this.show(`Name the model to ${op}.`, false); return; }
    if (op === "drain" && !confirm("Drain this node? It unloads every model after its requests finish.")) return;
    const self = this.status && node === this.status.node_id;
    const wait = { timeoutMs: (TIMEOUT_S + 30) * 1000 };
    this.show(`${op}…`, true);
    try {
      let answer;
      if (self && op === "load") {
        answer = await this.api.json("/api/models/load", { method: "POST", body: { model }, ...wait });
      } else if (self && op === "unload") {
        answer = await this.api.json("/api/models/unload", { method: "POST", body: { model, timeout_s: 60 }, ...wait });
      } else {
        const body = { node, op, timeout_s: TIMEOUT_S };
        if (op === "load" || op === "unload") body.model = model;
        const passphrase = $("control-passphrase").value;
        if (passphrase && !self) body.passphrase = passphrase;
        answer = await this.api.json("/api/owner/command", { method: "POST", body, ...wait });
      }
      const ok = !("ok" in answer) || answer.ok;
      this.show(op === "status" && ok ? JSON.stringify(answer.data, null, 2) : describeAnswer(op, answer), ok);
      if (ok && op !== "status") this.onChange();
    } catch (err) {
      this.show(`${op} failed: ${err.message}`, false);
    }
  }
}

/** The standby card: this node's standby state and its latest decisions; hidden on other nodes. */
export function renderStandby(card, body, standby) {
  card.hidden = !standby;
  if (!standby) return;
  const waiting = (standby.waiting || []).map((w) => `${w.model}: ${w.reason} for ${w.for_s} s`);
  replace(body,
    el("p", {}, el("strong", { text: standby.enabled ? "On" : "Paused" }),
      ` · library ${(standby.candidates || []).join(", ") || "empty"}`,
      ` · serving ${(standby.serving || []).join(", ") || "nothing"}`,
      ` · unloads after ${standby.idle_s} s idle`),
    waiting.length ? el("p", { class: "muted", text: `Waiting: ${waiting.join("; ")}` }) : "",
    (standby.decisions || []).length
      ? el("ol", { class: "records", reversed: true }, [...standby.decisions].reverse().map((d) =>
        el("li", { dataset: { action: d.action } },
          `${new Date(d.at * 1000).toLocaleTimeString([], { hour12: false })} ${d.action} ${d.model} (${d.reason})`)))
      : el("p", { class: "muted", text: "No decision yet." }));
}
