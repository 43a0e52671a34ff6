// The chat playground: a conversation streamed from /v1/chat/completions, with a model picker and
// the usual sampling parameters. Text is appended as it arrives; Stop cancels the request (the node
// then stops generating between two tokens).

import { el, replace } from "./dom.js";

const $ = (id) => document.getElementById(id);

/** The request body for `messages` from the form's fields; optional fields left empty are not sent. */
export function chatBody(form, messages) {
  const field = (name) => form.elements.namedItem(name).value;
  const num = (name) => (field(name).trim() === "" ? undefined : Number(field(name)));
  const stop = field("stop").split("\n").filter((s) => s.length > 0);
  const body = {
    model: field("model"), messages, stream: true, stream_options: { include_usage: true },
    temperature: num("temperature"), top_p: num("top_p"), max_tokens: num("max_tokens"), seed: num("seed"),
    stop: stop.length ? stop : undefined,
  };
  return Object.fromEntries(Object.entries(body).filter(([, v]) => v !== undefined));
}

export class Chat {
  constructor(api) {
    this.api = api;
    this.form = $("chat-form");
    this.log = $("chat-log");
    this.status = $("chat-status");
    this.history = [];
    this.ctrl = null;
    this.form.addEventListener("submit", (e) => { e.preventDefault(); this.send(); });
    $("chat-input").addEventListener("keydown", (e) => {
      if (e.key === "Enter" && !e.shiftKey && !e.isComposing) { e.preventDefault(); this.form.requestSubmit(); }
    });
    $("chat-stop").addEventListener("click", () => this.ctrl && this.ctrl.abort());
    $("chat-clear").addEventListener("click", () => {
      this.history = [];
      replace(this.log);
      this.say("Conversation cleared.");
    });
  }

  say(text) { this.status.textContent = text; }

  /** Offer the mesh's models (from /v1/models), keeping the current choice when it is still there. */
  setModels(models) {
    const select = this.form.elements.namedItem("model");
    const current = select.value;
    const ids = models.map((m) => m.id);
    if (ids.join("\n") === [...select.options].map((o) => o.value).join("\n")) return;
    replace(select, ids.map((id) => el("option", { value: id, text: id })));
    if (ids.includes(current)) select.value = current;
    $("chat-send").disabled = !ids.length || this.ctrl !== null;
    if (!ids.length) this.say("No model is served in this mesh yet.");
  }

  bubble(role, text) {
    const content = el("div", { class: "content", text });
    const item = el("article", { class: `msg ${role}`, dataset: { role } },
      el("p", { class: "who", text: role === "user" ? "You" : role === "assistant" ? "Model" : "Error" }), content);
    this.log.append(item);
    item.scrollIntoView({ block: "end" });
    return { item, content };
  }

  busy(on) {
    $("chat-send").disabled = on;
    $("chat-stop").disabled = !on;
    this.log.setAttribute("aria-busy", on ? "true" : "false");
  }

  async send() {
    const input = $("chat-input");
    const text = input.value.trim();
    if (!text || this.ctrl || !this.form.reportValidity()) return;
    const system = this.form.elements.namedItem("system").value.trim();
    const messages = [...(system ? [{ role: "system", content: system }] : []), ...this.history,
      { role: "user", content: text }];
    const body = chatBody(this.form, messages);
    input.value = "";
    this.bubble("user", text);
    const reply = this.bubble("assistant", "");
    reply.item.dataset.streaming = "true";
    this.ctrl = new AbortController();
    this.busy(true);
    this.say(`Asking ${body.model}…`);
    const started = performance.now();
    let first = null, usage = null, finish = null, failure = null;
    try {
      await this.api.stream("/v1/chat/completions", {
        method: "POST", body, signal: this.ctrl.signal, connectMs: 120000, idleMs: 90000,
        onEvent: ({ data }) => {
          if (data === "[DONE]") return;
          const chunk = JSON.parse(data);
          if (chunk.error) throw Object.assign(new Error(chunk.error.message), { name: "StreamError" });
          if (chunk.usage) usage = chunk.usage;
          const choice = chunk.choices?.[0];
          if (choice?.finish_reason) finish = choice.finish_reason;
          const delta = choice?.delta?.content;
          if (delta) {
            if (first === null) first = performance.now();
            reply.content.textContent += delta;
          }
        },
      });
    } catch (err) {
      failure = err;
    } finally {
      this.ctrl = null;
      this.busy(false);
      delete reply.item.dataset.streaming;
    }
    const said = reply.content.textContent;
    if (said) this.history.push({ role: "user", content: text }, { role: "assistant", content: said });
    if (failure && failure.name === "AbortError") {
      this.say("Stopped.");
      reply.item.dataset.finish = "cancelled";
    } else if (failure) {
      if (!said) reply.item.remove();
      this.bubble("error", failure.message).item.setAttribute("role", "alert");
      this.say("The request failed.");
    } else {
      reply.item.dataset.finish = finish || "stop";
      const secs = (performance.now() - (first ?? started)) / 1000;
      const tokens = usage?.completion_tokens;
      const parts = [tokens !== undefined ? `${tokens} tokens` : null,
        tokens && secs > 0 ? `${(tokens / secs).toFixed(1)} tok/s` : null,
        first !== null ? `first token after ${Math.round(first - started)} ms` : "no text",
        `finish: ${finish || "stop"}`].filter(Boolean);
      reply.item.append(el("p", { class: "meta", text: parts.join(" · ") }));
      this.say("Done.");
    }
    input.focus();
  }
}
