// The console's only way to the node: JSON calls and server-sent-event streams over fetch().
//
// Every call carries `Authorization: Bearer <token>` when the page holds one (the node's admin token,
// which `meshllm console` passes in the URL fragment, or an API key pasted by the user). Streams are
// read with fetch() and a body reader, because EventSource cannot send headers. Every wait has a
// deadline: JSON calls time out, and a stream that stays silent past its idle limit is aborted.

const TOKEN_KEY = "meshllm.token";

/** An error answer of the node (OpenAI's shape) or a failure to reach it. */
export class ApiError extends Error {
  constructor(status, code, message) {
    super(message);
    this.status = status; // HTTP status, 0 when the node could not be reached
    this.code = code;
  }
  get unauthorized() { return this.status === 401 || this.status === 403; }
}

/** Move a `#admin=TOKEN` fragment into session storage and out of the address bar. */
export function takeTokenFromFragment(storage) {
  const params = new URLSearchParams(location.hash.slice(1));
  const token = params.get("admin");
  if (token === null) return;
  if (token) storage.setItem(TOKEN_KEY, token);
  history.replaceState(null, "", location.pathname + location.search);
}

/** An abort signal for one call: fires on a deadline (re-armed as a stream makes progress) or when `outer` fires. */
class Deadline {
  constructor(outer) {
    this.ctrl = new AbortController();
    this.outer = outer;
    this.timer = null;
    this.follow = () => this.ctrl.abort(outer.reason);
    if (outer) {
      if (outer.aborted) this.follow(); else outer.addEventListener("abort", this.follow, { once: true });
    }
  }

  get signal() { return this.ctrl.signal; }

  /** (Re)start the clock: abort with a TimeoutError saying `why` unless re-armed within `ms`. */
  arm(ms, why) {
    clearTimeout(this.timer);
    this.timer = setTimeout(() => this.ctrl.abort(new DOMException(why, "TimeoutError")), ms);
  }

  /** Stop the clock and release the connection (also when a caller's handler threw). */
  close() {
    clearTimeout(this.timer);
    if (this.outer) this.outer.removeEventListener("abort", this.follow);
    this.ctrl.abort();
  }
}

async function errorOf(response) {
  let code = "http_error", message = `${response.status} ${response.statusText}`.trim();
  try {
    const body = await response.json();
    if (body && body.error) {
      message = String(body.error.message || message);
      code = String(body.error.code || code);
    }
  } catch { /* not JSON: keep the status line */ }
  return new ApiError(response.status, code, message);
}

/** Network failures and deadlines as ApiError (status 0); anything else (a cancel, a caller's error) as is. */
function unreachable(err) {
  if (err && err.name === "TimeoutError") return new ApiError(0, "timeout", err.message);
  if (err instanceof TypeError) return new ApiError(0, "unreachable", "the connection failed");
  return err;
}

/** Splits a server-sent-event byte stream into events (no I/O: fed text, returns what completed). */
export class SseParser {
  constructor() { this.buffer = ""; this.event = ""; this.data = []; }

  /** Feed decoded text; returns the events it completed as `{event, data}` (data as one string). */
  push(text) {
    this.buffer += text;
    const out = [];
    let nl;
    while ((nl = this.buffer.search(/\r\n|\r|\n/)) >= 0) {
      if (nl === this.buffer.length - 1 && this.buffer[nl] === "\r") break; // maybe the first half of \r\n
      const line = this.buffer.slice(0, nl);
      this.buffer = this.buffer.slice(nl + (this.buffer.startsWith("\r\n", nl) ? 2 : 1));
      if (line === "") {
        if (this.data.length) out.push({ event: this.event, data: this.data.join("\n") });
        this.event = ""; this.data = [];
        continue;
      }
      if (line.startsWith(":")) continue; // a comment: the keep-alive
      const colon = line.indexOf(":");
      const field = colon < 0 ? line : line.slice(0, colon);
      let value = colon < 0 ? "" : line.slice(colon + 1);
      if (value.startsWith(" ")) value = value.slice(1);
      if (field === "event") this.event = value;
      else if (field === "data") this.data.push(value);
    }
    return out;
  }
}

export class Api {
  constructor(storage = sessionStorage) { this.storage = storage; }

  get token() { return this.storage.getItem(TOKEN_KEY) || ""; }
  setToken(token) { if (token) this.storage.setItem(TOKEN_KEY, token); else this.storage.removeItem(TOKEN_KEY); }

  headers(json) {
    const h = {};
    if (json) h["Content-Type"] = "application/json";
    if (this.token) h["Authorization"] = `Bearer ${this.token}`;
    return h;
  }

  request(path, method, body, signal, accept) {
    const headers = { ...this.headers(body !== undefined), ...(accept ? { Accept: accept } : {}) };
    const payload = body === undefined ? undefined : JSON.stringify(body);
    return fetch(path, { method, headers, signal, cache: "no-store", body: payload });
  }

  /** One JSON call; resolves to the decoded body, rejects with ApiError. */
  async json(path, { method = "GET", body, timeoutMs = 8000, signal } = {}) {
    const deadline = new Deadline(signal);
    deadline.arm(timeoutMs, `no answer within ${timeoutMs / 1000} s`);
    try {
      const response = await this.request(path, method, body, deadline.signal);
      if (!response.ok) throw await errorOf(response);
      return await response.json();
    } catch (err) {
      throw unreachable(err);
    } finally {
      deadline.close();
    }
  }

  /**
   * A server-sent-event stream: calls `onEvent({event, data})` for each event until the stream ends.
   * The connection must answer within `connectMs`, then say something (a keep-alive counts) at least
   * every `idleMs`; `onOpen` runs once the node accepted the request.
   */
  async stream(path, { method = "GET", body, signal, onEvent, onOpen, connectMs = 10000, idleMs = 40000 }) {
    const deadline = new Deadline(signal);
    deadline.arm(connectMs, `no answer within ${connectMs / 1000} s`);
    try {
      const response = await this.request(path, method, body, deadline.signal, "text/event-stream");
      if (!response.ok) throw await errorOf(response);
      if (onOpen) onOpen();
      const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
      const parser = new SseParser();
      for (;;) {
        deadline.arm(idleMs, `silent for ${idleMs / 1000} s`);
        const { value, done } = await reader.read();
        if (done) return;
        for (const event of parser.push(value)) onEvent(event);
      }
    } catch (err) {
      throw unreachable(err);
    } finally {
      deadline.close();
    }
  }
}
