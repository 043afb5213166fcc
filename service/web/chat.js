// The chat box: streams /v1/chat/completions and keeps the conversation in the page.
import { readEvents } from "./sse.js";

const KEY_STORAGE = "moecache.apiKey";  // per tab: the key does not outlive the browser session

export class Chat {
  constructor(el) {
    this.el = el;  // {form, prompt, messages, apiKey, maxTokens, temperature, send, stop, clear, error}
    this.history = [];  // [{role, content}] sent with every request
    this.controller = null;
    el.apiKey.value = sessionStorage.getItem(KEY_STORAGE) || "";
    el.apiKey.addEventListener("change", () => sessionStorage.setItem(KEY_STORAGE, el.apiKey.value.trim()));
    el.form.addEventListener("submit", (event) => { event.preventDefault(); this.send(); });
    el.prompt.addEventListener("keydown", (event) => {
      if (event.key === "Enter" && !event.shiftKey) { event.preventDefault(); this.send(); }
    });
    el.stop.addEventListener("click", () => this.controller?.abort());
    el.clear.addEventListener("click", () => this.clear());
  }

  clear() {
    this.controller?.abort();
    this.history = [];
    this.el.messages.replaceChildren();
    this.showError("");
  }

  async send() {
    const text = this.el.prompt.value.trim();
    if (!text || this.controller) return;
    this.el.prompt.value = "";
    this.showError("");
    this.history.push({ role: "user", content: text });
    this.bubble("user", text);
    const reply = this.bubble("assistant", "");
    reply.dataset.state = "streaming";
    this.setBusy(true);
    try {
      const outcome = await this.stream(reply);
      this.history.push({ role: "assistant", content: outcome.text });
      this.finish(reply, "done", outcome);
    } catch (error) {
      this.history.pop();  // the question stays on screen but is not resent without an answer
      this.finish(reply, error.name === "AbortError" ? "stopped" : "error", null);
      if (error.name !== "AbortError") this.showError(error.message);
    } finally {
      this.setBusy(false);
    }
  }

  async stream(reply) {
    this.controller = new AbortController();
    const started = performance.now();
    const response = await fetch("/v1/chat/completions", {
      method: "POST",
      headers: this.headers(),
      body: JSON.stringify(this.body()),
      signal: this.controller.signal,
    });
    if (!response.ok) throw new Error(await errorText(response));
    const outcome = { text: "", tokens: 0, finish: null, seconds: 0 };
    const body = reply.querySelector(".text");
    for await (const data of readEvents(response)) {
      if (data === "[DONE]") break;
      const chunk = JSON.parse(data);
      if (chunk.error) throw new Error(chunk.error.message);
      const choice = chunk.choices?.[0];
      if (choice?.delta?.content) {
        outcome.text += choice.delta.content;
        body.textContent = outcome.text;
        this.scroll();
      }
      if (choice?.finish_reason) outcome.finish = choice.finish_reason;
      if (chunk.usage) outcome.tokens = chunk.usage.completion_tokens;
    }
    outcome.seconds = (performance.now() - started) / 1000;
    return outcome;
  }

  headers() {
    const headers = { "Content-Type": "application/json" };
    const key = this.el.apiKey.value.trim();
    if (key) headers.Authorization = `Bearer ${key}`;
    return headers;
  }

  body() {
    const maxTokens = parseInt(this.el.maxTokens.value, 10);
    const temperature = parseFloat(this.el.temperature.value);
    return {
      messages: this.history,
      stream: true,
      stream_options: { include_usage: true },
      ...(maxTokens > 0 ? { max_tokens: maxTokens } : {}),
      ...(temperature >= 0 ? { temperature } : {}),
    };
  }

  bubble(role, text) {
    const node = document.createElement("div");
    node.className = `message ${role}`;
    const body = document.createElement("span");
    body.className = "text";
    body.textContent = text;
    node.append(body);
    this.el.messages.append(node);
    this.scroll();
    return node;
  }

  finish(reply, state, outcome) {
    reply.dataset.state = state;
    const meta = document.createElement("span");
    meta.className = "meta";
    meta.textContent = outcome ? describe(outcome) : state;
    reply.append(meta);
    this.controller = null;
  }

  setBusy(busy) {
    this.el.send.disabled = busy;
    this.el.stop.disabled = !busy;
  }

  showError(message) {
    this.el.error.textContent = message;
    this.el.error.hidden = !message;
  }

  scroll() {
    this.el.messages.scrollTop = this.el.messages.scrollHeight;
  }
}

function describe({ tokens, seconds, finish }) {
  const rate = tokens && seconds > 0 ? `, ${(tokens / seconds).toFixed(1)} tokens/s` : "";
  return `${tokens} tokens in ${seconds.toFixed(2)} s${rate}, finish: ${finish ?? "none"}`;
}

async function errorText(response) {
  let message = `${response.status} ${response.statusText}`;
  try {
    const body = await response.json();
    if (body?.error?.message) message = body.error.message;
  } catch {
    // not JSON: keep the status line
  }
  if (response.status === 401) message += " (enter the server's API key above)";
  return message;
}
