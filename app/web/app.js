// The searchchat web client: asks over SSE (fetch streaming) or WebSocket, renders the
// streamed answer as sanitised Markdown with [N] citations, stops through
// POST /api/chat/cancel, and resumes an answer in flight after a reload.
"use strict";

const $ = (selector) => document.querySelector(selector);
const store = window.localStorage;

const state = {
  userId: store.getItem("userId") || randomId(),
  apiKey: store.getItem("apiKey") || "",
  chatId: null,
  turn: null, // the turn being streamed: {chatId, view, controller}
  socket: null,
};
store.setItem("userId", state.userId);

function randomId() {
  // a positive 62-bit decimal id, as the server's ids are
  const words = crypto.getRandomValues(new Uint32Array(2));
  return ((BigInt(words[0] & 0x3fffffff) << 32n) | BigInt(words[1])).toString();
}

function headers(extra = {}) {
  const out = { ...extra };
  if (state.apiKey) out.Authorization = `Bearer ${state.apiKey}`;
  return out;
}

async function api(path, options = {}) {
  const response = await fetch(path, { ...options, headers: headers(options.headers) });
  if (response.status === 401 && askForKey()) return api(path, options);
  return response;
}

function askForKey() {
  const key = window.prompt("This server needs an API key:");
  if (!key) return false;
  state.apiKey = key.trim();
  store.setItem("apiKey", state.apiKey);
  return true;
}

// ---- rendering --------------------------------------------------------------------

class TurnView {
  constructor(question) {
    this.el = $("#turn-template").content.firstElementChild.cloneNode(true);
    this.el.querySelector(".question").textContent = question;
    this.answer = "";
    this.reasoning = "";
    this.sources = [];
    this.pending = false;
    this.el.dataset.state = "streaming";
    $("#empty").hidden = true;
    $("#conversation").appendChild(this.el);
    this.scroll();
  }

  part(name) {
    return this.el.querySelector(`.${name}`);
  }

  scroll() {
    const pane = $("#conversation");
    pane.scrollTop = pane.scrollHeight;
  }

  onEvent(event) {
    switch (event.type) {
      case "rewrited":
        this.progress(`searching for: ${event.content}`);
        break;
      case "progress":
        this.progress(event.data);
        break;
      case "sources":
        this.showSources(event.data);
        break;
      case "reasoning":
        this.reasoning += event.data;
        this.part("reasoning").hidden = false;
        this.part("reasoning-text").textContent = this.reasoning;
        break;
      case "message":
        this.answer += event.data;
        this.render();
        break;
      case "messageEnd":
        this.end(event.status);
        break;
      case "error":
        this.end("error", event.data);
        break;
    }
  }

  progress(text) {
    const line = document.createElement("div");
    line.textContent = text;
    this.part("progress").appendChild(line);
  }

  showSources(entries) {
    const box = this.part("sources");
    box.replaceChildren();
    this.sources = entries.filter((s) => s.metadata && s.metadata.title !== "All Sources");
    this.sources.forEach((source, i) => {
      const card = document.createElement("a");
      card.className = "source";
      card.href = safeUrl(source.metadata.url);
      card.target = "_blank";
      card.rel = "noopener noreferrer";
      const title = document.createElement("span");
      title.className = "t";
      title.innerHTML = `<span class="n">${i + 1}</span>`;
      title.append(source.metadata.title || source.metadata.url);
      const host = document.createElement("div");
      host.className = "h";
      host.textContent = hostOf(source.metadata.url);
      card.append(title, host);
      box.appendChild(card);
    });
    const all = entries.find((s) => s.metadata && s.metadata.title === "All Sources");
    if (all) {
      const link = document.createElement("a");
      link.className = "source all";
      link.href = safeUrl(all.metadata.url);
      link.target = "_blank";
      link.rel = "noopener noreferrer";
      link.textContent = "All sources";
      box.appendChild(link);
    }
  }

  render() {
    if (this.pending) return;
    this.pending = true;
    requestAnimationFrame(() => {
      this.pending = false;
      this.part("answer").innerHTML = markdown(this.answer, this.sources);
      this.scroll();
    });
  }

  end(status, detail) {
    this.part("progress").classList.add("done");
    this.part("answer").innerHTML = markdown(this.answer, this.sources);
    const line = this.part("status");
    line.className = `status ${status === "cancelled" ? "stopped" : status}`;
    line.textContent =
      status === "cancelled" ? "stopped" : status === "error" || status === "failed" ? `failed: ${detail || ""}` : "";
    this.el.dataset.state = status === "error" ? "failed" : status || "completed";
  }
}

function markdown(text, sources) {
  const cited = text.replace(/\[(\d+)\]/g, (whole, n) => {
    const source = sources[Number(n) - 1];
    if (!source) return whole;
    return `<a class="cite" href="${escapeAttr(safeUrl(source.metadata.url))}" target="_blank" rel="noopener noreferrer">[${n}]</a>`;
  });
  const html = window.marked ? window.marked.parse(cited) : escapeHtml(cited);
  return window.DOMPurify ? window.DOMPurify.sanitize(html, { ADD_ATTR: ["target"] }) : escapeHtml(text);
}

function safeUrl(url) {
  if (typeof url !== "string") return "#";
  if (url.startsWith("//") || /^https?:\/\//i.test(url)) return url;
  return "#";
}

function hostOf(url) {
  try {
    return new URL(url, window.location.href).host;
  } catch {
    return "";
  }
}

function escapeHtml(text) {
  const div = document.createElement("div");
  div.textContent = text;
  return div.innerHTML;
}

function escapeAttr(text) {
  return text.replace(/&/g, "&amp;").replace(/"/g, "&quot;").replace(/</g, "&lt;");
}

// ---- streaming ------------------------------------------------------------------------

// Reads an SSE response body, calling onEvent(json, id) per event.
async function readSse(response, onEvent) {
  const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += value;
    let cut;
    while ((cut = buffer.indexOf("\n\n")) >= 0) {
      const block = buffer.slice(0, cut);
      buffer = buffer.slice(cut + 2);
      let id = null;
      const data = [];
      for (const line of block.split("\n")) {
        if (line.startsWith("id:")) id = line.slice(3).trim();
        else if (line.startsWith("data:")) data.push(line.slice(5).trim());
      }
      if (data.length) onEvent(JSON.parse(data.join("\n")), id);
    }
  }
}

function remember(chatId, eventId) {
  const inflight = { chatId, answerId: eventId ? eventId.split(":")[0] : null };
  store.setItem("inflight", JSON.stringify(inflight));
}

function settle() {
  store.removeItem("inflight");
  state.turn = null;
  $("#stop").hidden = true;
  $("#send").disabled = false;
  refreshChats();
  // a new chat is named by the model once its answer is out: look again shortly
  setTimeout(refreshChats, 1500);
}

function deliver(turn, event, eventId) {
  if (eventId) remember(turn.chatId, eventId);
  turn.view.onEvent(event);
  if (event.type === "messageEnd" || event.type === "error") settle();
}

async function askOverSse(turn, body) {
  turn.controller = new AbortController();
  let response;
  try {
    response = await api("/api/chat/sse", {
      method: "POST",
      headers: { "Content-Type": "application/json" },
      body: JSON.stringify(body),
      signal: turn.controller.signal,
    });
  } catch (error) {
    return deliver(turn, { type: "error", data: String(error) });
  }
  if (!response.ok) {
    const error = await response.json().catch(() => ({ data: response.statusText }));
    return deliver(turn, { type: "error", data: error.data });
  }
  await readSse(response, (event, id) => deliver(turn, event, id)).catch(() => {});
}

function socket() {
  if (state.socket && state.socket.readyState <= WebSocket.OPEN) return state.socket;
  const scheme = window.location.protocol === "https:" ? "wss:" : "ws:";
  const token = state.apiKey ? `?token=${encodeURIComponent(state.apiKey)}` : "";
  const ws = new WebSocket(`${scheme}//${window.location.host}/api/chat/ws${token}`);
  ws.ready = new Promise((resolve) => ws.addEventListener("open", resolve, { once: true }));
  ws.addEventListener("message", (message) => {
    const frame = JSON.parse(message.data);
    const turn = state.turn;
    if (!turn || (frame.chatId && frame.chatId !== turn.chatId)) return;
    if (frame.type === "signal" || frame.type === "pong" || frame.type === "cancelled") return;
    deliver(turn, frame, frame.eventId);
  });
  ws.addEventListener("close", () => {
    if (state.socket === ws) state.socket = null;
  });
  state.socket = ws;
  return ws;
}

async function askOverWebSocket(turn, body) {
  const ws = socket();
  await ws.ready;
  ws.send(JSON.stringify(body));
}

async function ask(question) {
  if (!state.chatId) state.chatId = randomId();
  const view = new TurnView(question);
  const turn = { chatId: state.chatId, view };
  state.turn = turn;
  $("#stop").hidden = false;
  $("#send").disabled = true;
  remember(turn.chatId, null);
  const body = {
    type: "message",
    userId: state.userId,
    message: { chatId: state.chatId, messageId: randomId(), content: question },
    focusMode: $("#focus").value,
    optimizationMode: $("#mode").value,
    copilotEnabled: $("#copilot").checked,
  };
  if ($("#transport").value === "ws") await askOverWebSocket(turn, body);
  else await askOverSse(turn, body);
}

async function stop() {
  const turn = state.turn;
  if (!turn) return;
  const response = await api("/api/chat/cancel", {
    method: "POST",
    headers: { "Content-Type": "application/json" },
    body: JSON.stringify({ chatId: turn.chatId, userId: state.userId }),
  });
  if (response.status === 404 && state.turn === turn) {
    turn.view.end("cancelled");
    settle();
  }
}

// After a reload: show the chat, then replay its answer in flight from its first event.
async function resumeInFlight() {
  const inflight = JSON.parse(store.getItem("inflight") || "null");
  if (!inflight) return;
  await openChat(inflight.chatId, { skipStreaming: true });
  const messages = state.lastMessages || [];
  const question = messages.filter((m) => m.role === "user").pop();
  const view = new TurnView(question ? question.content : "");
  const turn = { chatId: inflight.chatId, view };
  state.turn = turn;
  $("#stop").hidden = false;
  $("#send").disabled = true;
  const lastEventId = inflight.answerId ? `${inflight.answerId}:0` : "";
  const url = `/api/chat/sse/resume?chatId=${encodeURIComponent(inflight.chatId)}&userId=${state.userId}`;
  const response = await api(url, { headers: lastEventId ? { "Last-Event-ID": lastEventId } : {} });
  if (!response.ok) {
    view.el.remove();
    settle();
    return openChat(inflight.chatId);
  }
  await readSse(response, (event, id) => deliver(turn, event, id)).catch(() => {});
}

// ---- chats --------------------------------------------------------------------------

async function refreshChats() {
  const response = await api(`/api/chats?userId=${state.userId}`);
  if (!response.ok) return;
  const { chats } = await response.json();
  const list = $("#chats");
  list.replaceChildren();
  for (const chat of chats) {
    const item = document.createElement("li");
    item.dataset.chatId = chat.id;
    if (chat.id === state.chatId) item.classList.add("active");
    const open = document.createElement("button");
    open.className = "open";
    open.type = "button";
    const title = document.createElement("span");
    title.className = "title";
    title.textContent = chat.title;
    const when = document.createElement("time");
    when.dateTime = chat.createdAt;
    when.textContent = new Date(chat.createdAt).toLocaleString();
    open.append(title, when);
    open.addEventListener("click", () => openChat(chat.id));
    const remove = document.createElement("button");
    remove.className = "delete";
    remove.type = "button";
    remove.title = "Delete this chat";
    remove.textContent = "×";
    remove.addEventListener("click", () => deleteChat(chat.id));
    item.append(open, remove);
    list.appendChild(item);
  }
}

function clearConversation() {
  for (const turn of document.querySelectorAll("#conversation .turn")) turn.remove();
  $("#empty").hidden = false;
}

async function openChat(chatId, { skipStreaming = false } = {}) {
  if (state.turn) return;
  const response = await api(`/api/chats/${chatId}?userId=${state.userId}`);
  if (!response.ok) return;
  const { messages } = await response.json();
  state.chatId = chatId;
  state.lastMessages = messages;
  clearConversation();
  let view = null;
  for (const message of messages) {
    if (message.role === "user") {
      if (skipStreaming && isLastQuestionStreaming(messages, message)) continue;
      view = new TurnView(message.content);
      if (message.sources && message.sources.length) view.showSources(message.sources);
    } else if (view && !(skipStreaming && message.status === "streaming")) {
      view.reasoning = message.reasoning || "";
      if (view.reasoning) {
        view.part("reasoning").hidden = false;
        view.part("reasoning-text").textContent = view.reasoning;
      }
      view.answer = message.content;
      view.end(message.status === "completed" ? "" : message.status);
    }
  }
  refreshChats();
}

function isLastQuestionStreaming(messages, question) {
  const answer = messages.find((m) => m.role === "assistant" && m.questionMessageId === question.id);
  return answer && answer.status === "streaming";
}

async function deleteChat(chatId) {
  const response = await api(`/api/chats/${chatId}?userId=${state.userId}`, { method: "DELETE" });
  if (response.ok && chatId === state.chatId) {
    state.chatId = null;
    clearConversation();
  }
  refreshChats();
}

// ---- wiring ---------------------------------------------------------------------------

document.addEventListener("DOMContentLoaded", async () => {
  $("#ask").addEventListener("submit", (event) => {
    event.preventDefault();
    const question = $("#question").value.trim();
    if (!question || state.turn) return;
    $("#question").value = "";
    ask(question);
  });
  $("#question").addEventListener("keydown", (event) => {
    if (event.key === "Enter" && !event.shiftKey) {
      event.preventDefault();
      $("#ask").requestSubmit();
    }
  });
  $("#stop").addEventListener("click", stop);
  $("#new-chat").addEventListener("click", () => {
    if (state.turn) return;
    state.chatId = null;
    clearConversation();
    refreshChats();
  });
  $("#focus").addEventListener("change", () => {
    $("#copilot").disabled = $("#focus").value !== "webSearch";
  });
  await refreshChats();
  await resumeInFlight();
});
