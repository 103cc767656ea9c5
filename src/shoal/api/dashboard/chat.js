// The chat pane: one conversation with a model picked from /v1/models, streamed from
// POST /v1/chat/completions (stream: true) through fetch() and a ReadableStream.

import { Unauthorized, authHeaders, errorMessage } from "./api.js";
import { el } from "./cluster.js";

// A model asked for on first use may load first; after that each piece of the stream must
// follow the last within the idle limit (the server sends keep-alives while it waits).
const FIRST_BYTE_TIMEOUT_MS = 180000;
const IDLE_TIMEOUT_MS = 60000;

// Text deltas (and an error, if one came) from the SSE lines of one chat completion.
export function parseEvents(lines) {
  const deltas = [];
  let error = null, done = false;
  for (const line of lines) {
    if (!line.startsWith("data: ")) continue; // comments (keep-alives) and blank lines
    const data = line.slice(6).trim();
    if (data === "[DONE]") { done = true; continue; }
    const event = JSON.parse(data);
    if (event.error) { error = event.error.message || String(event.error); continue; }
    for (const choice of event.choices || []) {
      if (choice.delta && choice.delta.content) deltas.push(choice.delta.content);
    }
  }
  return { deltas, error, done };
}

export class ChatPane {
  constructor(onUnauthorized) {
    this.onUnauthorized = onUnauthorized;
    this.messages = [];
    this.controller = null;
    this.picker = document.getElementById("chat-model");
    this.input = document.getElementById("chat-input");
    this.log = document.getElementById("chat-log");
    this.status = document.getElementById("chat-status");
    this.sendButton = document.getElementById("chat-send");
    this.stopButton = document.getElementById("chat-stop");
    this.maxTokens = document.getElementById("chat-max-tokens");
    document.getElementById("chat-form").addEventListener("submit", (event) => {
      event.preventDefault();
      this.send();
    });
    this.input.addEventListener("keydown", (event) => {
      if (event.key === "Enter" && !event.shiftKey) { event.preventDefault(); this.send(); }
    });
    this.stopButton.addEventListener("click", () => this.stop("stopped"));
    document.getElementById("chat-clear").addEventListener("click", () => {
      this.stop("cleared");
      this.messages = [];
      this.log.replaceChildren();
    });
  }

  // The picker's options from /v1/models, keeping the user's choice; ready models first.
  setModels(models) {
    const chosen = this.picker.value;
    const ids = models.map((m) => m.id);
    if (ids.join("\n") === [...this.picker.options].map((o) => o.value).join("\n")) return;
    this.picker.replaceChildren(...models.map((m) =>
      el("option", { value: m.id }, m.state === "available" ? m.id : `${m.id} (${m.state})`)));
    if (ids.includes(chosen)) this.picker.value = chosen;
  }

  stop(reason) {
    if (this.controller) this.controller.abort(new Error(reason));
  }

  async send() {
    const text = this.input.value.trim();
    const model = this.picker.value;
    if (!text || this.controller) return;
    if (!model) { this.status.textContent = "no model to chat with"; return; }
    this.input.value = "";
    this.messages.push({ role: "user", content: text });
    this.log.append(el("div", { class: "message user" }, text));
    const reply = el("div", { class: "message assistant", "data-state": "waiting" });
    this.log.append(reply);
    this.sendButton.disabled = true;
    this.stopButton.disabled = false;
    this.controller = new AbortController();
    try {
      const answer = await this.stream(model, reply, this.controller);
      this.messages.push({ role: "assistant", content: answer });
      reply.dataset.state = "done";
    } catch (error) {
      this.messages.pop(); // the question went unanswered: not part of the conversation
      reply.dataset.state = "error";
      reply.append(el("div", { class: "error" }, error.message));
      if (error instanceof Unauthorized) this.onUnauthorized();
    } finally {
      this.controller = null;
      this.sendButton.disabled = false;
      this.stopButton.disabled = true;
    }
  }

  // Streams one reply into the element; resolves to its text. Throws Unauthorized on 401
  // and an Error whose message is for the user on any other failure.
  async stream(model, reply, controller) {
    let timeoutMs = FIRST_BYTE_TIMEOUT_MS;
    let timer = null;
    const arm = () => {
      clearTimeout(timer);
      timer = setTimeout(() => controller.abort(new Error(`no answer within ${timeoutMs / 1000} s`)),
        timeoutMs);
    };
    const body = { model, messages: this.messages, stream: true };
    const maxTokens = parseInt(this.maxTokens.value, 10);
    if (maxTokens > 0) body.max_tokens = maxTokens;
    const started = performance.now();
    let text = "", pieces = 0;
    arm();
    try {
      const response = await fetch("/v1/chat/completions", {
        method: "POST", signal: controller.signal, body: JSON.stringify(body),
        headers: { ...authHeaders(), "content-type": "application/json" },
      });
      if (!response.ok) {
        const message = errorMessage(response.status, await response.text());
        throw response.status === 401 ? new Unauthorized(message) : new Error(message);
      }
      timeoutMs = IDLE_TIMEOUT_MS;
      reply.dataset.state = "streaming";
      const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
      let buffer = "";
      for (;;) {
        arm();
        const { value, done } = await reader.read();
        if (done) break;
        buffer += value;
        const lines = buffer.split("\n");
        buffer = lines.pop(); // an incomplete line waits for the rest
        const events = parseEvents(lines);
        for (const delta of events.deltas) { text += delta; pieces += 1; }
        reply.textContent = text;
        if (events.error) throw new Error(events.error);
        const seconds = (performance.now() - started) / 1000;
        this.status.textContent =
          `${pieces} pieces in ${seconds.toFixed(1)} s (${(pieces / seconds).toFixed(1)}/s)`;
      }
      return text;
    } catch (error) {
      // An aborted fetch throws the reason it was given: a timeout, Stop or Clear.
      if (controller.signal.aborted) throw controller.signal.reason;
      if (error instanceof Unauthorized || !(error instanceof TypeError)) throw error;
      throw new Error(`cannot reach the node (${error.message})`); // fetch's network failure
    } finally {
      clearTimeout(timer);
    }
  }
}
