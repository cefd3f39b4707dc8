// The chat page of `k3 serve`: the conversation lives in this page and is sent whole with every request to
// /v1/chat/completions; the reply streams back as Server-Sent Events read from the fetch body.
"use strict";

const $ = (id) => document.getElementById(id);
const KEY_ITEM = "k3-api-key";
const SAMPLING = [["temperature", "temperature"], ["top-p", "top_p"], ["max-tokens", "max_tokens"], ["seed", "seed"]];

const state = {model: null, messages: [], controller: null};

function authHeaders() {
  const key = $("api-key").value.trim();
  return key ? {Authorization: `Bearer ${key}`} : {};
}

function showError(message) {
  $("error").textContent = message;
  $("error").hidden = !message;
}

function setStatus(name, text) {
  $("status").dataset.state = name;
  $("status").textContent = text;
}

function setBusy(busy) {
  $("send").disabled = busy || state.model === null;
  $("stop").disabled = !busy;
  if (busy) setStatus("busy", "generating…");
  else if (state.model === null) setStatus("error", "no model");
  else setStatus("ready", "ready");
}

// The message of an OpenAI error body, or the status line and the start of the body.
async function errorMessage(response) {
  const text = await response.text();
  try {
    const message = JSON.parse(text).error?.message;
    if (message) return message;
  } catch {
    // not JSON: fall through
  }
  return `${response.status} ${response.statusText}${text ? `: ${text.slice(0, 200)}` : ""}`;
}

async function loadModel() {
  setStatus("loading", "loading");
  try {
    const response = await fetch("/v1/models", {headers: authHeaders()});
    if (!response.ok) throw new Error(await errorMessage(response));
    state.model = (await response.json()).data[0].id;
    $("model").textContent = state.model;
    showError("");
  } catch (err) {
    state.model = null;
    $("model").textContent = "no model";
    showError(`Listing the models failed: ${err.message}`);
  }
  setBusy(state.controller !== null);
}

// The events of an SSE body: {event, data} with the data lines joined.
async function* serverSentEvents(body) {
  const reader = body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "", event = "message", data = [];
  for (;;) {
    const {value, done} = await reader.read();
    if (done) return;
    const lines = (buffer + value).split(/\r\n|\r|\n/);
    buffer = lines.pop();
    for (const line of lines) {
      if (line === "") {
        if (data.length) yield {event, data: data.join("\n")};
        event = "message";
        data = [];
      } else if (line.startsWith("data:")) {
        data.push(line.slice(5).replace(/^ /, ""));
      } else if (line.startsWith("event:")) {
        event = line.slice(6).trim();
      }
    }
  }
}

function addTurn(role, text = "") {
  const turn = document.createElement("article");
  turn.className = `turn ${role}`;
  const content = document.createElement("div");
  content.className = "content";
  content.textContent = text;
  turn.append(content);
  $("conversation").append(turn);
  turn.scrollIntoView({block: "end"});
  return turn;
}

// The text element of a turn's reasoning block, created (open) on first use.
function reasoningText(turn) {
  let details = turn.querySelector("details.reasoning");
  if (!details) {
    details = document.createElement("details");
    details.className = "reasoning";
    details.open = true;
    const summary = document.createElement("summary");
    summary.textContent = "Reasoning";
    const text = document.createElement("div");
    text.className = "reasoning-text";
    details.append(summary, text);
    turn.prepend(details);
  }
  return details.querySelector(".reasoning-text");
}

function samplingFields() {
  const fields = {};
  for (const [id, name] of SAMPLING) {
    const value = $(id).value.trim();
    if (value !== "") fields[name] = Number(value);
  }
  return fields;
}

// Streams one reply into `turn`; returns {reasoning, content, finish, error}.
async function stream(messages, turn) {
  const reply = {reasoning: "", content: "", finish: null, error: null};
  const mode = document.querySelector("input[name=mode]:checked").value;
  const request = {model: state.model, messages, stream: true, mode, ...samplingFields()};
  try {
    const response = await fetch("/v1/chat/completions", {
      method: "POST", headers: {"Content-Type": "application/json", ...authHeaders()},
      body: JSON.stringify(request), signal: state.controller.signal,
    });
    if (!response.ok) throw new Error(await errorMessage(response));
    for await (const {event, data} of serverSentEvents(response.body)) {
      if (data === "[DONE]") break;
      const chunk = JSON.parse(data);
      if (event === "error" || chunk.error) throw new Error(chunk.error?.message ?? "the stream failed");
      const choice = chunk.choices?.[0];
      if (!choice) continue;
      const delta = choice.delta ?? {};
      if (delta.reasoning_content) {
        reply.reasoning += delta.reasoning_content;
        reasoningText(turn).textContent = reply.reasoning;
      }
      if (delta.content) {
        if (!reply.content && reply.reasoning) turn.querySelector("details.reasoning").open = false;
        reply.content += delta.content;
        turn.querySelector(".content").textContent = reply.content;
      }
      reply.finish = choice.finish_reason ?? reply.finish;
    }
  } catch (err) {
    if (err.name === "AbortError") reply.finish = "stopped";
    else reply.error = err;
  }
  return reply;
}

async function send(text) {
  showError("");
  const messages = state.messages;
  messages.push({role: "user", content: text});
  const userTurn = addTurn("user", text);
  const turn = addTurn("assistant");
  turn.classList.add("streaming");
  state.controller = new AbortController();
  setBusy(true);
  const reply = await stream(messages, turn);
  state.controller = null;
  turn.classList.remove("streaming");
  if (reply.reasoning || reply.content) {
    messages.push({role: "assistant", content: reply.content, reasoning_content: reply.reasoning});
    const note = reply.error ? "failed" : reply.finish === "stopped" ? "stopped" : reply.finish;
    if (note && note !== "stop") {
      const meta = document.createElement("div");
      meta.className = "meta";
      meta.textContent = note === "length" ? "stopped at the token limit" : note;
      turn.append(meta);
    }
  } else {  // nothing came back: take the message back into the text box
    messages.pop();
    userTurn.remove();
    turn.remove();
    if (messages === state.messages && !$("prompt").value) $("prompt").value = text;
  }
  if (reply.error) showError(reply.error.message);
  setBusy(false);
}

function newChat() {
  state.controller?.abort();
  state.messages = [];
  $("conversation").replaceChildren();
  showError("");
  $("prompt").focus();
}

$("composer").addEventListener("submit", (event) => {
  event.preventDefault();
  const text = $("prompt").value;
  if (!text.trim() || state.controller || state.model === null) return;
  $("prompt").value = "";
  send(text);
});
$("prompt").addEventListener("keydown", (event) => {
  if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
    event.preventDefault();
    $("composer").requestSubmit();
  }
});
$("stop").addEventListener("click", () => state.controller?.abort());
$("new-chat").addEventListener("click", newChat);
$("api-key").addEventListener("change", () => {
  const key = $("api-key").value.trim();
  if (key) sessionStorage.setItem(KEY_ITEM, key);
  else sessionStorage.removeItem(KEY_ITEM);
  loadModel();
});

// The key lives in this tab's sessionStorage (gone when the tab closes); pages before it kept it in localStorage.
localStorage.removeItem(KEY_ITEM);
$("api-key").value = sessionStorage.getItem(KEY_ITEM) ?? "";
loadModel();
$("prompt").focus();
