// nanollmserve playground: chat and completions against this server's OpenAI API, plus a
// live panel polling /stats (the Timeline tab is timeline.js). Plain JS, no build step, no
// third-party code.
//
// Safety rule: model output is untrusted. It only ever reaches the page as text nodes
// (textContent / createTextNode); nothing here assigns innerHTML or builds HTML strings.
"use strict";

const KEY_STORAGE = "nanollmserve.apiKey";
const STATS_INTERVAL_MS = 1000;
const SPARK_POINTS = 60;

const $ = (id) => document.getElementById(id);

// ---------------------------------------------------------------- state

const state = {
  messages: [], // the conversation: {role, content}
  controller: null, // AbortController of the request in flight
  completionController: null,
  tpsHistory: [],
  lastStats: null, // {time, generated}
};

// ---------------------------------------------------------------- HTTP helpers

function authHeaders() {
  const key = $("api-key").value.trim();
  return key ? { Authorization: "Bearer " + key } : {};
}

// A readable message for an HTTP error answer (OpenAI error shape when the server sent one).
async function errorMessage(response) {
  let detail = "";
  try {
    const body = await response.json();
    detail = (body.error && body.error.message) || JSON.stringify(body);
  } catch (_) {
    detail = response.statusText;
  }
  if (response.status === 401) {
    return "401 Unauthorized: this server needs an API key. Enter it in the API key field " +
      "at the top. (" + detail + ")";
  }
  return response.status + ": " + detail;
}

// POSTs a streaming request and calls onChunk(obj) for each SSE `data:` JSON payload.
// Throws an Error with a readable message on an HTTP error or an in-stream error event.
async function streamSSE(path, body, signal, onChunk) {
  const response = await fetch(path, {
    method: "POST",
    headers: { "Content-Type": "application/json", ...authHeaders() },
    body: JSON.stringify(body),
    signal,
  });
  if (!response.ok) throw new Error(await errorMessage(response));
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buffer += decoder.decode(value, { stream: true });
    // Events are separated by a blank line; keep an incomplete tail for the next read.
    const events = buffer.split(/\r?\n\r?\n/);
    buffer = events.pop();
    for (const event of events) {
      for (const line of event.split(/\r?\n/)) {
        if (!line.startsWith("data:")) continue;
        const data = line.slice(5).trim();
        if (data === "[DONE]") return;
        const obj = JSON.parse(data);
        if (obj.error) throw new Error("server error: " + obj.error.message);
        onChunk(obj);
      }
    }
  }
}

// ---------------------------------------------------------------- safe markdown

// Renders a small markdown subset into `parent` using elements and text nodes only:
// ``` fenced code ```, `inline code`, **bold**, *italic*, paragraphs, - / 1. lists.
function renderMarkdown(parent, text) {
  parent.replaceChildren();
  const parts = text.split(/^```/m);
  parts.forEach((part, i) => {
    if (i % 2 === 1) {
      // Inside a fence: the first line is the language tag, the rest is verbatim code.
      const newline = part.indexOf("\n");
      const code = newline < 0 ? "" : part.slice(newline + 1);
      const pre = document.createElement("pre");
      const el = document.createElement("code");
      el.textContent = code.replace(/\n$/, "");
      pre.appendChild(el);
      parent.appendChild(pre);
    } else {
      renderBlocks(parent, part);
    }
  });
}

function renderBlocks(parent, text) {
  let list = null; // the <ul>/<ol> being filled, if the previous line was a list item
  let paragraph = [];
  const flushParagraph = () => {
    if (paragraph.length) {
      const p = document.createElement("p");
      renderInline(p, paragraph.join("\n"));
      parent.appendChild(p);
      paragraph = [];
    }
  };
  for (const line of text.split("\n")) {
    const item = line.match(/^\s*([-*+]|\d+[.)])\s+(.*)$/);
    if (item) {
      flushParagraph();
      const tag = /\d/.test(item[1]) ? "ol" : "ul";
      if (!list || list.tagName.toLowerCase() !== tag) {
        list = document.createElement(tag);
        parent.appendChild(list);
      }
      const li = document.createElement("li");
      renderInline(li, item[2]);
      list.appendChild(li);
    } else if (line.trim() === "") {
      flushParagraph();
      list = null;
    } else {
      list = null;
      paragraph.push(line);
    }
  }
  flushParagraph();
}

const INLINE = /(`[^`\n]+`|\*\*[^*\n]+\*\*|\*[^*\n]+\*|_[^_\n]+_)/;

function renderInline(parent, text) {
  // split() with a capturing group alternates plain text and matched spans.
  text.split(INLINE).forEach((piece, i) => {
    if (!piece) return;
    if (i % 2 === 0) {
      parent.appendChild(document.createTextNode(piece));
      return;
    }
    let tag = "em";
    let inner = piece.slice(1, -1);
    if (piece.startsWith("`")) tag = "code";
    else if (piece.startsWith("**")) {
      tag = "strong";
      inner = piece.slice(2, -2);
    }
    const el = document.createElement(tag);
    el.textContent = inner;
    parent.appendChild(el);
  });
}

// ---------------------------------------------------------------- settings

function numberOrNull(id) {
  const raw = $(id).value.trim();
  return raw === "" ? null : Number(raw);
}

// Sampling fields shared by chat and completions; empty fields are left to the server.
function samplingParams() {
  const params = {};
  for (const name of ["temperature", "top_p", "top_k", "seed"]) {
    const value = numberOrNull(name);
    if (value !== null) params[name] = value;
  }
  const stop = $("stop").value.split(",").map((s) => s.trim()).filter(Boolean);
  if (stop.length) params.stop = stop;
  const model = $("model").value;
  if (model) params.model = model;
  return params;
}

async function loadModels() {
  const select = $("model");
  try {
    const response = await fetch("/v1/models", { headers: authHeaders() });
    if (!response.ok) {
      showError("error", await errorMessage(response));
      return;
    }
    hideError("error");
    const current = select.value;
    select.replaceChildren();
    for (const card of (await response.json()).data) {
      const option = document.createElement("option");
      option.value = card.id;
      option.textContent = card.id;
      select.appendChild(option);
    }
    if (current) select.value = current;
  } catch (err) {
    showError("error", "cannot reach the server: " + err.message);
  }
}

function showError(id, text) {
  $(id).textContent = text;
  $(id).hidden = false;
}

function hideError(id) {
  $(id).hidden = true;
  $(id).textContent = "";
}

// ---------------------------------------------------------------- chat

function addMessageView(role, text) {
  const wrap = document.createElement("div");
  wrap.className = "message " + role;
  const head = document.createElement("div");
  head.className = "message-head";
  const who = document.createElement("span");
  who.textContent = role;
  const copy = document.createElement("button");
  copy.type = "button";
  copy.className = "copy";
  copy.textContent = "Copy";
  copy.addEventListener("click", () => {
    navigator.clipboard.writeText(wrap.dataset.raw || "").catch(() => {});
  });
  head.append(who, copy);
  const body = document.createElement("div");
  body.className = "message-body";
  const stats = document.createElement("div");
  stats.className = "reply-stats";
  wrap.append(head, body, stats);
  $("messages").appendChild(wrap);
  setMessageText(wrap, text);
  return wrap;
}

function setMessageText(wrap, text) {
  wrap.dataset.raw = text;
  renderMarkdown(wrap.querySelector(".message-body"), text);
  const list = $("messages");
  list.scrollTop = list.scrollHeight;
}

function redrawConversation() {
  $("messages").replaceChildren();
  for (const m of state.messages) addMessageView(m.role, m.content);
}

function setBusy(busy) {
  $("send").disabled = busy;
  $("stop-button").disabled = !busy;
}

function formatReplyStats(ttft, seconds, usage) {
  const parts = [];
  if (ttft !== null) parts.push("TTFT " + (ttft * 1000).toFixed(0) + " ms");
  if (usage) {
    const decode = seconds - (ttft || 0);
    if (usage.completion_tokens > 1 && decode > 0) {
      parts.push(((usage.completion_tokens - 1) / decode).toFixed(1) + " tok/s");
    }
    const cached = (usage.prompt_tokens_details && usage.prompt_tokens_details.cached_tokens) || 0;
    parts.push("prompt " + usage.prompt_tokens + " (cached " + cached + ")");
    parts.push("completion " + usage.completion_tokens);
  }
  return parts.join(" · ");
}

async function sendChat(text) {
  hideError("error");
  const system = $("system").value.trim();
  state.messages.push({ role: "user", content: text });
  addMessageView("user", text);
  const view = addMessageView("assistant", "");
  view.classList.add("streaming");
  const body = {
    ...samplingParams(),
    messages: (system ? [{ role: "system", content: system }] : []).concat(state.messages),
    stream: true,
    stream_options: { include_usage: true },
  };
  const maxTokens = numberOrNull("max_tokens");
  if (maxTokens !== null) body.max_completion_tokens = maxTokens;

  state.controller = new AbortController();
  setBusy(true);
  const start = performance.now();
  let ttft = null;
  let usage = null;
  let reply = "";
  let finish = null;
  try {
    await streamSSE("/v1/chat/completions", body, state.controller.signal, (chunk) => {
      if (chunk.usage) usage = chunk.usage;
      const choice = chunk.choices && chunk.choices[0];
      if (!choice) return;
      if (choice.finish_reason) finish = choice.finish_reason;
      const delta = choice.delta && choice.delta.content;
      if (delta) {
        if (ttft === null) ttft = (performance.now() - start) / 1000;
        reply += delta;
        setMessageText(view, reply);
      }
    });
  } catch (err) {
    if (err.name === "AbortError") finish = "stopped";
    else showError("error", err.message);
  } finally {
    state.controller = null;
    setBusy(false);
    view.classList.remove("streaming");
  }
  const seconds = (performance.now() - start) / 1000;
  if (reply || usage) {
    state.messages.push({ role: "assistant", content: reply });
    let line = formatReplyStats(ttft, seconds, usage);
    if (finish) line += (line ? " · " : "") + finish;
    view.querySelector(".reply-stats").textContent = line;
  } else {
    // Nothing came back (an error or Stop before the first token): take the turn back and
    // return its text to the composer, so it can be resent (say, after entering a key).
    state.messages.pop();
    redrawConversation();
    if (!$("prompt").value) $("prompt").value = text;
  }
}

function onChatSubmit(event) {
  event.preventDefault();
  const text = $("prompt").value.trim();
  if (!text || state.controller) return;
  $("prompt").value = "";
  sendChat(text);
}

// Takes the last user turn (and the reply after it) out of the conversation and puts its
// text back in the composer to edit and resend.
function editLast() {
  if (state.controller) return;
  let i = state.messages.length - 1;
  while (i >= 0 && state.messages[i].role !== "user") i--;
  if (i < 0) return;
  $("prompt").value = state.messages[i].content;
  state.messages.length = i;
  redrawConversation();
  $("prompt").focus();
}

function newChat() {
  if (state.controller) state.controller.abort();
  state.messages = [];
  redrawConversation();
  hideError("error");
}

// ---------------------------------------------------------------- completions

function tokenTitle(logprobs, i) {
  const lp = logprobs.token_logprobs[i];
  let title = "logprob " + (lp === null || lp === undefined ? "n/a" : lp.toFixed(3));
  const top = logprobs.top_logprobs && logprobs.top_logprobs[i];
  if (top) {
    const alts = Object.entries(top).map(([tok, v]) => JSON.stringify(tok) + " " + v.toFixed(3));
    title += "\ntop: " + alts.join(", ");
  }
  return title;
}

async function sendCompletion(event) {
  event.preventDefault();
  if (state.completionController) return;
  hideError("completion-error");
  const out = $("completion-output");
  out.replaceChildren();
  $("completion-stats").textContent = "";
  const prompt = $("raw-prompt").value;
  const body = {
    ...samplingParams(),
    prompt,
    logprobs: 3,
    stream: true,
    stream_options: { include_usage: true },
  };
  const maxTokens = numberOrNull("max_tokens");
  if (maxTokens !== null) body.max_tokens = maxTokens;
  const promptSpan = document.createElement("span");
  promptSpan.className = "prompt-text";
  promptSpan.textContent = prompt;
  out.appendChild(promptSpan);

  state.completionController = new AbortController();
  $("complete").disabled = true;
  $("stop-completion").disabled = false;
  const start = performance.now();
  let ttft = null;
  let usage = null;
  try {
    await streamSSE("/v1/completions", body, state.completionController.signal, (chunk) => {
      if (chunk.usage) usage = chunk.usage;
      const choice = chunk.choices && chunk.choices[0];
      if (!choice) return;
      if (choice.text && ttft === null) ttft = (performance.now() - start) / 1000;
      const lp = choice.logprobs;
      if (lp && lp.tokens && lp.tokens.length) {
        lp.tokens.forEach((tok, i) => {
          const span = document.createElement("span");
          span.className = "token";
          span.textContent = tok;
          span.title = tokenTitle(lp, i);
          out.appendChild(span);
        });
      } else if (choice.text) {
        out.appendChild(document.createTextNode(choice.text));
      }
    });
  } catch (err) {
    if (err.name !== "AbortError") showError("completion-error", err.message);
  } finally {
    state.completionController = null;
    $("complete").disabled = false;
    $("stop-completion").disabled = true;
  }
  $("completion-stats").textContent = formatReplyStats(ttft, (performance.now() - start) / 1000, usage);
}

// ---------------------------------------------------------------- live stats panel

async function pollStats() {
  try {
    const response = await fetch("/stats", { headers: authHeaders(), cache: "no-store" });
    if (!response.ok) {
      $("live-status").textContent = response.status === 401 ? "(needs API key)" : "(" + response.status + ")";
      return;
    }
    const s = await response.json();
    $("live-status").textContent = s.is_healthy ? "" : "(unhealthy)";
    $("stat-running").textContent = s.num_requests_running;
    $("stat-waiting").textContent = s.num_requests_waiting;
    $("stat-kv").textContent = (s.kv_cache_usage * 100).toFixed(1) + "%";
    $("stat-kv-bar").value = s.kv_cache_usage;
    $("stat-prefix").textContent = s.prefix_cache_queries
      ? (s.prefix_cache_hit_rate * 100).toFixed(1) + "%"
      : "-";
    $("stat-gen-total").textContent = s.num_generation_tokens;
    // Tokens/s from the counter's change since the previous poll.
    const now = performance.now();
    if (state.lastStats) {
      const dt = (now - state.lastStats.time) / 1000;
      const tps = dt > 0 ? Math.max(0, s.num_generation_tokens - state.lastStats.generated) / dt : 0;
      $("stat-tps").textContent = tps.toFixed(1);
      state.tpsHistory.push(tps);
      if (state.tpsHistory.length > SPARK_POINTS) state.tpsHistory.shift();
      drawSparkline();
    }
    state.lastStats = { time: now, generated: s.num_generation_tokens };
    renderWorkers(s.workers);
  } catch (_) {
    $("live-status").textContent = "(offline)";
  }
}

// Behind `nanollmserve router`, /stats adds up the workers and lists them: one row each.
function renderWorkers(workers) {
  const list = $("stat-workers");
  list.hidden = !Array.isArray(workers);
  if (list.hidden) return;
  list.replaceChildren(
    ...workers.map((w) => {
      const row = document.createElement("li");
      row.className = w.is_healthy ? "worker-up" : "worker-down";
      const running = w.stats ? w.stats.num_requests_running : "-";
      row.textContent =
        w.url + ": " + (w.is_healthy ? "up" : "down") + ", running " + running +
        ", in flight " + w.num_in_flight + ", routed " + w.num_routed;
      return row;
    }),
  );
}

function drawSparkline() {
  const canvas = $("sparkline");
  const ctx = canvas.getContext("2d");
  const { width, height } = canvas;
  ctx.clearRect(0, 0, width, height);
  const values = state.tpsHistory;
  if (values.length < 2) return;
  const max = Math.max(1, ...values);
  ctx.strokeStyle = "#2f7de1";
  ctx.lineWidth = 1.5;
  ctx.beginPath();
  values.forEach((v, i) => {
    const x = (i / (SPARK_POINTS - 1)) * width;
    const y = height - 2 - (v / max) * (height - 4);
    if (i === 0) ctx.moveTo(x, y);
    else ctx.lineTo(x, y);
  });
  ctx.stroke();
}

// ---------------------------------------------------------------- wiring

// Shows the pane `pane-NAME` and tells the other scripts (timeline.js) which tab is open.
function switchTab(name) {
  for (const tab of document.querySelectorAll(".tab")) {
    tab.classList.toggle("active", tab.dataset.tab === name);
  }
  for (const pane of document.querySelectorAll(".pane")) {
    pane.hidden = pane.id !== "pane-" + name;
  }
  for (const el of document.querySelectorAll(".chat-only")) el.hidden = name !== "chat";
  document.dispatchEvent(new CustomEvent("playground:tab", { detail: name }));
}

function init() {
  // The key lives in sessionStorage only: gone when the tab closes, never sent elsewhere.
  $("api-key").value = sessionStorage.getItem(KEY_STORAGE) || "";
  $("api-key").addEventListener("input", () => {
    sessionStorage.setItem(KEY_STORAGE, $("api-key").value.trim());
  });
  $("api-key").addEventListener("change", () => {
    loadModels();
    pollStats();
  });
  $("chat-form").addEventListener("submit", onChatSubmit);
  $("prompt").addEventListener("keydown", (event) => {
    if (event.key === "Enter" && !event.shiftKey) onChatSubmit(event);
  });
  $("stop-button").addEventListener("click", () => state.controller && state.controller.abort());
  $("new-chat").addEventListener("click", newChat);
  $("edit-last").addEventListener("click", editLast);
  $("completion-form").addEventListener("submit", sendCompletion);
  $("stop-completion").addEventListener("click", () => {
    if (state.completionController) state.completionController.abort();
  });
  for (const tab of document.querySelectorAll(".tab")) {
    tab.addEventListener("click", () => switchTab(tab.dataset.tab));
  }
  loadModels();
  pollStats();
  setInterval(pollStats, STATS_INTERVAL_MS);
}

document.addEventListener("DOMContentLoaded", init);
