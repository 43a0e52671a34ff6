// Owner actions on the mesh owner's node: create invites (with a copy button), revoke an invite or a
// node, publish and unpublish the mesh. The node decides who may do them (its admin token or API
// key); the page only says why a button is disabled and shows the node's answer.

import { el, replace, setText, shortId } from "./dom.js";

const $ = (id) => document.getElementById(id);
const BUTTONS = ["invite-create", "revoke-submit", "publish-on", "publish-off"];

/** Why management is unavailable now, or "" when it is available. */
export function gateReason(status, hasToken) {
  if (!status) return "Waiting for the node's status.";
  if (status.mesh_owner === false) {
    return "This node does not hold the mesh key: open the console of the node that created the mesh.";
  }
  if (!hasToken) {
    return "Read-only: enter the node's admin token or API key under Access (meshllm console opens this page with it).";
  }
  return "";
}

async function copy(text, input) {
  try {
    await navigator.clipboard.writeText(text);
  } catch {
    input.select(); // no clipboard permission (e.g. not a secure context): the old way
    if (!document.execCommand("copy")) throw new Error("the browser refused to copy; select the token and copy it");
  }
}

export class Owner {
  constructor(api, onToken) {
    this.api = api;
    this.onToken = onToken;
    this.status = null;
    this.invites = $("invites");
    this.note = $("owner-note");
    this.result = $("owner-result");
    $("token-form").addEventListener("submit", (e) => {
      e.preventDefault();
      const value = $("token-input").value.trim();
      $("token-input").value = "";
      this.setToken(value);
    });
    $("token-forget").addEventListener("click", () => this.setToken(""));
    $("invite-form").addEventListener("submit", (e) => { e.preventDefault(); this.createInvite(); });
    $("revoke-form").addEventListener("submit", (e) => {
      e.preventDefault();
      this.revoke($("revoke-kind").value, $("revoke-target").value.trim());
    });
    $("publish-form").addEventListener("submit", (e) => { e.preventDefault(); this.publish(true); });
    $("publish-off").addEventListener("click", () => this.publish(false));
    this.renderAccess();
  }

  setToken(token) {
    this.api.setToken(token);
    this.renderAccess();
    this.update(this.status);
    this.onToken();
  }

  renderAccess(rejected) {
    const has = Boolean(this.api.token);
    setText($("token-state"), rejected ? `The node refused the token: ${rejected}`
      : has ? "A token is set for this tab; every call sends it." : "No token: the console is read-only.");
    $("token-state").classList.toggle("bad", Boolean(rejected));
    $("token-forget").disabled = !has;
  }

  /** A new snapshot: enable or disable the buttons and refresh the published state. */
  update(status) {
    const first = !this.status && status;
    this.status = status;
    const reason = gateReason(status, Boolean(this.api.token));
    setText(this.note, reason);
    this.note.hidden = !reason;
    for (const id of BUTTONS) $(id).disabled = Boolean(reason);
    if (first && status.mesh_owner) this.refreshPublish();
    this.renderMembers(status);
  }

  show(message, ok) {
    this.result.textContent = message;
    this.result.className = ok ? "result ok" : "result bad";
  }

  failed(action, err) {
    if (err.unauthorized) this.renderAccess(err.message);
    this.show(`${action} failed: ${err.message}`, false);
  }

  async createInvite() {
    const body = { ttl_s: Number($("invite-ttl").value), max_uses: Number($("invite-uses").value) };
    try {
      const answer = await this.api.json("/api/invite", { method: "POST", body });
      this.addInvite(answer);
      this.show(`Invite ${answer.invite_id || ""} created.`, true);
    } catch (err) {
      this.failed("Creating the invite", err);
    }
  }

  addInvite(answer) {
    const id = answer.invite_id || "";
    const field = el("input", { class: "token", readonly: true, value: answer.token, "aria-label": `Invite token ${id}` });
    const expires = answer.expires ? new Date(answer.expires * 1000).toLocaleString() : "?";
    const uses = answer.max_uses === 0 ? "unlimited uses" : `${answer.max_uses} use${answer.max_uses === 1 ? "" : "s"}`;
    const copied = el("span", { class: "muted", "aria-live": "polite" });
    const item = el("li", { class: "invite", dataset: { inviteId: id } },
      el("p", {}, el("strong", { text: id ? `Invite ${id}` : "Invite" }),
        el("span", { class: "muted", text: ` · expires ${expires} · ${uses}` })),
      el("div", { class: "row" }, field,
        el("button", { type: "button", class: "copy", onclick: async () => {
          try {
            await copy(answer.token, field);
            copied.textContent = "Copied.";
          } catch (err) {
            copied.textContent = err.message;
          }
        } }, "Copy"),
        id ? el("button", { type: "button", class: "danger", onclick: () => this.revoke("invite", id) }, "Revoke") : null),
      copied);
    this.invites.prepend(item);
  }

  async revoke(kind, target) {
    if (!target) { this.show("Name the invite id or node id to revoke.", false); return; }
    if (!confirm(`Revoke ${kind} ${target}? Every member refuses it from now on.`)) return;
    try {
      const answer = await this.api.json("/api/revoke", { method: "POST", body: { kind, target } });
      this.show(`Revoked ${answer.kind} ${answer.target}.`, true);
      const item = this.invites.querySelector(`li[data-invite-id="${CSS.escape(answer.target)}"]`);
      if (item) item.classList.add("revoked");
    } catch (err) {
      this.failed("Revoking", err);
    }
  }

  async refreshPublish() {
    try {
      this.renderPublish(await this.api.json("/api/publish"));
    } catch (err) {
      $("publish-state").textContent = `Publishing state unknown: ${err.message}`;
    }
  }

  renderPublish(info) {
    const where = [info.lan ? "the LAN" : "", info.dht ? "the DHT" : ""].filter(Boolean).join(" and ");
    $("publish-state").textContent = info.published
      ? `Published as “${info.name}” on ${where || "its listing endpoint"}; `
        + `others join with: meshllm join ${info.mesh_id}`
      : "Not published: only holders of an invite can join.";
    $("publish-state").dataset.published = String(Boolean(info.published));
  }

  async publish(on) {
    const name = $("publish-name").value.trim();
    try {
      const body = on ? (name ? { name } : {}) : { off: true };
      this.renderPublish(await this.api.json("/api/publish", { method: "POST", body, timeoutMs: 30000 }));
      this.show(on ? "Published." : "Unpublished.", true);
    } catch (err) {
      this.failed(on ? "Publishing" : "Unpublishing", err);
    }
  }

  /** Members other than this node, each with a button to revoke it. */
  renderMembers(status) {
    const peers = (status?.peers || []).filter((p) => p.state === "alive" || p.state === "suspect");
    const disabled = Boolean(gateReason(status, Boolean(this.api.token)));
    replace($("members"), peers.length ? peers.map((p) => el("li", { dataset: { nodeId: p.node_id } },
      el("span", {}, el("strong", { text: p.name || shortId(p.node_id) }),
        el("code", { text: ` ${shortId(p.node_id)}…` })),
      el("button", { type: "button", class: "danger", disabled, "aria-describedby": "owner-note",
        dataset: { focusKey: `revoke-${p.node_id}` },
        onclick: () => this.revoke("node", p.node_id) }, `Revoke ${p.name || shortId(p.node_id)}`)))
      : el("li", { class: "muted", text: "No other members." }));
  }
}
