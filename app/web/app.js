// The searchchat web client: asks over SSE (a streaming fetch) or WebSocket, shows the
// answer as it streams, stops it, and follows it across lost connections by resuming
// with Last-Event-ID. Chats live on the server; settings in this browser.
import {
  api,
  auth,
  explain,
  Failure,
  failureOf,
  getJson,
  postJson,
  randomId,
  readSse,
  sentence,
  setKey,
  Socket,
  upload,
  withUser,
  withUserBody,
} from "./net.js";
import { button, fileChip, searchFix, site, TurnView } from "./turn.js";
import { nextAfterSignIn, showAccount, showKeys, showSignIn, signInAgain, whoAmI } from "./account.js";
import { chosenModel, loadModels, showAnsweredBy } from "./models.js";

const $ = (selector) => document.querySelector(selector);
const store = window.localStorage;

/** Pauses between attempts to resume an answer whose connection broke (ms). */
const BACKOFF = [300, 1000, 2000, 4000, 8000]; // ~15 s: a restart on a busy host takes a while

const FOCUS_LABELS = {
  webSearch: "Web",
  academicSearch: "Academic",
  youtubeSearch: "YouTube",
  redditSearch: "Reddit",
  wolframAlphaSearch: "Wolfram Alpha",
  deepResearch: "Deep research",
  deepSeek: "Chat",
  mathAssistant: "Math",
  writingAssistant: "Writing",
  translator: "Translate",
};
/** Focus modes whose answers search the web (the optimization mode applies to them). */
const SEARCHING = new Set(["webSearch", "academicSearch", "youtubeSearch", "redditSearch", "wolframAlphaSearch"]);

const DEFAULTS = {
  transport: "sse",
  focus: "webSearch",
  mode: "speed",
  copilot: true,
  theme: "system",
  media: false,
  domains: [], // the search's domains: "arxiv.org" keeps to it, "-pinterest.com" leaves it out
  recency: "", // "", or hour | day | week | month | year
};
const settings = { ...DEFAULTS, ...JSON.parse(store.getItem("settings") || "{}") };

const state = {
  config: null,
  chatId: null,
  turn: null, // the answer being received (see startLive)
  follow: true, // auto-scroll: follows the answer until the reader scrolls up
  attachments: [], // files picked for the next question: {name, status, fileId, chip}
  notice: null, // a message for the banner once the page is up (a refused sign-in)
  touched: new Set(), // controls the reader changed in this chat ("focus", "mode"): defaults leave them
};

const socket = new Socket(onFrame, onSocketClose);

// ---- asking --------------------------------------------------------------------------

const hooks = {
  copy,
  regenerate: (view) => ask(view.question, { messageId: view.messageId, replace: view }),
  edit: (view, text) => ask(text, { messageId: view.messageId, replace: view }),
  retry,
  media,
  pick: (text) => ask(text),
  enterKey: async (view) => {
    if (await auth.askForKey("needed")) retry(view);
  },
};

/** Ask `content` in the open chat; with `replace`, that turn is asked again (regenerate,
 * edit) and it and every later turn make way, as the server deletes them. */
async function ask(content, { messageId = randomId(), replace = null } = {}) {
  if (state.turn) return;
  if (!state.chatId) {
    state.chatId = randomId();
    history.replaceState(null, "", `#chat=${state.chatId}`);
  }
  if (replace) removeFrom(replace.el);
  const files = state.attachments.filter((a) => a.status === "ready");
  const view = new TurnView(content, hooks, files.map((f) => f.name));
  view.messageId = messageId;
  showConversation();
  const focusMode = $("#focus").value;
  const body = withUserBody({
    type: "message",
    message: { chatId: state.chatId, messageId, content },
    focusMode,
    optimizationMode: $("#mode").value,
    copilotEnabled: $("#copilot").checked,
    files: files.map((f) => f.fileId),
    ...searchControls(),
    ...chosenModel($("#model")),
    ...chosenServers(),
  });
  if (files.length) {
    addChatFiles(files.map((f) => f.name));
    clearAttachments();
  }
  state.follow = true;
  scrollToEnd();
  const live = startLive(view, state.chatId, body);
  await receive(live, send);
}

function startLive(view, chatId, body = null) {
  const live = {
    view,
    chatId,
    body,
    controller: new AbortController(),
    lastEventId: view.lastEventId || null,
    received: 0,
    done: false,
    resolveWs: null,
  };
  state.turn = live;
  setBusy(true);
  return live;
}

/** Runs `first` (send or resume), then resumes with backoff while the connection breaks. */
async function receive(live, first) {
  let outcome = await first(live);
  for (let attempt = 0; outcome === "broken" && !live.done; attempt++) {
    if (attempt >= BACKOFF.length) return fail(live, new Failure("UNREACHABLE", "resuming failed"));
    live.view.connection(`Lost the connection to the server. Reconnecting (${attempt + 1} of ${BACKOFF.length})…`);
    if (!(await pause(BACKOFF[attempt], live.controller.signal))) return;
    const before = live.received;
    outcome = await resume(live);
    if (live.received > before) attempt = -1; // it got further: count the attempts again
  }
  if (outcome === "lost") hooks.regenerate(live.view);
}

async function send(live) {
  if (settings.transport === "ws") return sendOverWs(live);
  let response;
  try {
    response = await api("/api/chat/sse", {
      method: "POST",
      headers: { "Content-Type": "application/json" },
      body: JSON.stringify(live.body),
      signal: live.controller.signal,
    });
  } catch (error) {
    if (error.name === "AbortError") return "aborted";
    fail(live, error);
    return "ended";
  }
  if (!response.ok) {
    fail(live, await failureOf(response));
    return "ended";
  }
  return follow(live, response);
}

async function sendOverWs(live) {
  try {
    await socket.send(live.body);
  } catch (error) {
    fail(live, error instanceof Failure ? error : new Failure("UNREACHABLE", String(error)));
    return "ended";
  }
  return new Promise((resolve) => {
    live.ws = socket.ws;
    live.resolveWs = resolve;
    live.controller.signal.addEventListener("abort", () => resolve("aborted"));
  });
}

function onFrame(frame, ws) {
  const live = state.turn;
  if (!live || !live.resolveWs || live.ws !== ws) return;
  if (["signal", "pong", "cancelled", "keep-alive"].includes(frame.type)) return;
  if (frame.chatId && frame.chatId !== live.chatId) return;
  deliver(live, frame, frame.eventId);
}

function onSocketClose(code, ws) {
  const live = state.turn;
  if (!live || !live.resolveWs || live.ws !== ws || live.done) return;
  if (code === 4401) return fail(live, new Failure("UNAUTHORIZED"));
  const resolve = live.resolveWs;
  live.resolveWs = null; // what follows comes by SSE resume
  resolve("broken");
}

/** GET /api/chat/sse/resume from the last event received; a generation the server no
 * longer has (404) is looked up in the chat instead. */
async function resume(live) {
  const url = withUser(`/api/chat/sse/resume?chatId=${encodeURIComponent(live.chatId)}`);
  let response;
  try {
    response = await api(url, {
      headers: live.lastEventId ? { "Last-Event-ID": live.lastEventId } : {},
      signal: live.controller.signal,
    });
  } catch (error) {
    return error.name === "AbortError" ? "aborted" : "broken";
  }
  if (response.status === 404) return recover(live);
  if (!response.ok) {
    if (response.status >= 500 || response.status === 429) return "broken";
    fail(live, await failureOf(response));
    return "ended";
  }
  live.view.connection(null);
  if (!live.lastEventId) live.view.reset(); // the whole generation is replayed
  return follow(live, response);
}

async function follow(live, response) {
  try {
    await readSse(response, (event, id) => deliver(live, event, id));
  } catch (error) {
    if (live.controller.signal.aborted) return "aborted";
  }
  return live.done ? "ended" : "broken";
}

/** The answer as saved, when its stream is gone: finished, or lost with the server. */
async function recover(live) {
  let chat;
  try {
    chat = await getJson(withUser(`/api/chats/${live.chatId}`));
  } catch (error) {
    if (error.key === "UNREACHABLE") return "broken";
    fail(live, error);
    return "ended";
  }
  const view = live.view;
  const saved = chat.messages.find((m) => m.role === "assistant" && m.questionMessageId === view.messageId);
  if (saved && (saved.status === "completed" || saved.status === "cancelled")) {
    view.answer = saved.content;
    view.reasoning = saved.reasoning || "";
    view.showSources(saved.sources || []);
    deliver(live, { type: "messageEnd", status: saved.status });
    return "ended";
  }
  if (live.orRegenerate) {
    finishHere(live);
    return "lost";
  }
  if (saved && saved.content.length > view.answer.length) view.answer = saved.content;
  fail(live, new Failure("LOST"));
  return "ended";
}

function deliver(live, event, id) {
  if (live.done) return;
  if (id) live.lastEventId = live.view.lastEventId = id;
  live.received++;
  live.view.onEvent(event);
  if (event.type === "messageEnd") showAnsweredBy(live.view, event.chatModel);
  if (event.type === "messageEnd" || event.type === "error") settle(live, event);
}

function fail(live, failure) {
  deliver(live, { type: "error", key: failure.key, data: failure.detail, retryAfter: failure.retryAfter });
}

/** The turn is over (`event`: its last event, null when it was ended here). */
function settle(live, event) {
  finishHere(live);
  refreshChats();
  setTimeout(refreshChats, 1500); // a new chat gets its title once the answer is out
  if (event && event.type === "messageEnd" && event.status === "completed") {
    suggest(live.view);
    if (settings.media) for (const kind of ["images", "videos"]) media(live.view, kind);
  }
}

function finishHere(live) {
  live.done = true;
  if (live.resolveWs) live.resolveWs("ended");
  live.resolveWs = null;
  if (state.turn === live) {
    state.turn = null;
    setBusy(false);
  }
}

/** Stop: cancel on the server, and end the stream here whatever the server says. */
async function stop() {
  const live = state.turn;
  if (!live || live.stopping) return;
  live.stopping = true;
  let cancelled = false;
  try {
    const response = await api("/api/chat/cancel", {
      method: "POST",
      headers: { "Content-Type": "application/json" },
      body: JSON.stringify(withUserBody({ chatId: live.chatId })),
    });
    cancelled = response.ok;
  } catch {
    // unreachable: end it here
  }
  if (!cancelled) return abandon(live);
  setTimeout(() => abandon(live), 3000); // the stream ends "cancelled" at once, normally
}

function abandon(live) {
  if (live.done) return;
  live.controller.abort();
  live.view.end("cancelled");
  settle(live, null);
}

/** Leave the answer being received (another chat opens): the server goes on and saves it. */
function detach() {
  const live = state.turn;
  if (!live) return;
  live.controller.abort();
  finishHere(live);
}

async function retry(view) {
  if (state.turn) return;
  const broken = view.el.dataset.error === "UNREACHABLE" && view.lastEventId;
  if (!broken) return hooks.regenerate(view);
  // the server may have gone on with it: pick it up, else ask again
  const live = startLive(view, state.chatId);
  live.orRegenerate = true;
  view.connection("Reconnecting…");
  view.el.dataset.state = "streaming";
  view.part("actions").hidden = true;
  await receive(live, resume);
}

function pause(ms, signal) {
  return new Promise((resolve) => {
    if (signal.aborted) return resolve(false);
    const timer = setTimeout(() => resolve(true), ms);
    signal.addEventListener("abort", () => {
      clearTimeout(timer);
      resolve(false);
    });
  });
}

function setBusy(busy) {
  $("#send").hidden = busy;
  $("#stop").hidden = !busy;
  document.body.classList.toggle("busy", busy);
}

// ---- per answer: copy, media, follow-ups ------------------------------------------------

async function copy(view, control) {
  try {
    await navigator.clipboard.writeText(view.answer);
  } catch {
    const scratch = document.createElement("textarea");
    scratch.value = view.answer;
    document.body.append(scratch);
    scratch.select();
    document.execCommand("copy");
    scratch.remove();
  }
  const label = control.querySelector(".label");
  label.textContent = "Copied";
  setTimeout(() => (label.textContent = "Copy"), 1500);
}

async function media(view, kind) {
  const control = view.el.querySelector(`.actions .${kind}`);
  if (control) control.disabled = true;
  view.showMedia(kind, null);
  try {
    const found = await postJson(`/api/${kind}`, { query: view.question, chatHistory: historyBefore(view) });
    view.showMedia(kind, found[kind] || []);
  } catch (error) {
    view.showMedia(kind, [], explain(error.key, error.detail).text);
  }
}

function historyBefore(view) {
  const out = [];
  for (const turn of turnViews()) {
    if (turn === view) break;
    out.push({ role: "user", content: turn.question }, { role: "assistant", content: turn.answer });
  }
  return out;
}

async function suggest(view) {
  const views = turnViews();
  if (views[views.length - 1] !== view) return;
  try {
    const { suggestions } = await postJson("/api/suggestions", { chatId: state.chatId, ...chosenModel($("#model")) });
    const now = turnViews();
    if (now[now.length - 1] === view && !state.turn) view.showRelated((suggestions || []).slice(0, 5));
  } catch {
    // follow-ups are a nicety: none is fine
  }
}

// ---- the conversation on the page --------------------------------------------------------

function turnViews() {
  return [...document.querySelectorAll("#turns .turn")].map((el) => el.turnView);
}

function removeFrom(el) {
  let node = el;
  while (node) {
    const next = node.nextElementSibling;
    node.remove();
    node = next;
  }
}

function showConversation() {
  $("#empty").hidden = Boolean(document.querySelector("#turns .turn"));
}

function clearConversation() {
  $("#turns").replaceChildren();
  $("#chat-files").replaceChildren();
  $("#chat-files").hidden = true;
  showConversation();
}

function addChatFiles(names) {
  const bar = $("#chat-files");
  if (!bar.childElementCount) {
    const label = document.createElement("span");
    label.className = "hint";
    label.textContent = "Files in this chat:";
    bar.append(label);
  }
  for (const name of names) bar.append(fileChip(name));
  bar.hidden = false;
}

// auto-scroll: follow the end while answers grow, until the reader scrolls up
const pane = $("#conversation");
let lastTop = 0;
let scrollQueued = false;

function gap() {
  return pane.scrollHeight - pane.scrollTop - pane.clientHeight;
}

function scrollToEnd() {
  pane.scrollTop = pane.scrollHeight;
  lastTop = pane.scrollTop;
  $("#jump").hidden = true;
}

pane.addEventListener("scroll", () => {
  if (gap() < 24) state.follow = true;
  else if (pane.scrollTop < lastTop - 1) state.follow = false;
  lastTop = pane.scrollTop;
  $("#jump").hidden = state.follow || gap() < 24;
});

$("#turns").addEventListener("grew", () => {
  if (scrollQueued) return;
  scrollQueued = true;
  requestAnimationFrame(() => {
    scrollQueued = false;
    if (state.follow) scrollToEnd();
    else $("#jump").hidden = gap() < 24;
  });
});

$("#jump").addEventListener("click", () => {
  state.follow = true;
  scrollToEnd();
});

// ---- chats ------------------------------------------------------------------------------

async function refreshChats() {
  let chats;
  try {
    ({ chats } = await getJson(withUser("/api/chats")));
  } catch {
    return;
  }
  const list = $("#chats");
  const shown = JSON.stringify([state.chatId, chats]);
  if (list.dataset.shown === shown) return; // unchanged: keep the buttons (and the focus)
  list.dataset.shown = shown;
  const focused = document.activeElement && list.contains(document.activeElement);
  list.replaceChildren();
  for (const chat of chats) {
    const item = document.createElement("li");
    item.dataset.chatId = chat.id;
    if (chat.id === state.chatId) {
      item.classList.add("active");
      $("#topbar-title").textContent = chat.title;
    }
    const open = document.createElement("button");
    open.className = "open";
    open.type = "button";
    const title = document.createElement("span");
    title.className = "title";
    title.textContent = chat.title;
    const when = document.createElement("time");
    when.dateTime = chat.createdAt;
    when.textContent = new Date(chat.createdAt).toLocaleString([], { dateStyle: "medium", timeStyle: "short" });
    open.append(title, when);
    open.addEventListener("click", () => go(chat.id));
    const remove = button("delete", "Delete", "trash", `Delete “${chat.title}”`);
    remove.setAttribute("aria-label", `Delete chat “${chat.title}”`);
    remove.addEventListener("click", () => deleteChat(chat.id, chat.title));
    item.append(open, remove);
    list.append(item);
  }
  if (focused && !list.contains(document.activeElement)) $("#new-chat").focus();
}

/** Open a chat through the address (#chat=…), so reload and Back keep it. */
function go(chatId) {
  if (chatId === state.chatId) return closeDrawer();
  window.location.hash = `chat=${chatId}`;
}

function route() {
  const match = /^#chat=([A-Za-z0-9_-]{1,64})$/.exec(window.location.hash);
  if (match) {
    if (match[1] !== state.chatId || !document.querySelector("#turns .turn")) openChat(match[1]);
    else closeDrawer();
  } else if (state.chatId) {
    newChat();
  }
}

async function openChat(chatId) {
  detach();
  closeDrawer();
  let data;
  try {
    data = await getJson(withUser(`/api/chats/${chatId}`));
  } catch (error) {
    if (error.key === "NOT_FOUND") history.replaceState(null, "", window.location.pathname);
    else banner(explain(error.key, error.detail).text);
    return;
  }
  state.chatId = chatId;
  clearConversation();
  state.touched.clear();
  setFocus(data.chat.focusMode);
  $("#topbar-title").textContent = data.chat.title || "searchchat";
  if (data.chat.files && data.chat.files.length) addChatFiles(data.chat.files.map((f) => f.name));
  let view = null;
  let unanswered = null;
  const messages = data.messages;
  for (const message of messages) {
    if (message.role === "user") {
      if (unanswered) unanswered.end("failed");
      view = unanswered = new TurnView(message.content, hooks);
      view.messageId = message.messageId || message.id;
      if (message.sources && message.sources.length) view.showSources(message.sources);
    } else if (view) {
      unanswered = null;
      if (message.status === "streaming" && message === messages[messages.length - 1]) {
        unanswered = view; // still being written: resumed below
        continue;
      }
      view.answer = message.content;
      view.reasoning = message.reasoning || "";
      if (view.reasoning) {
        view.part("reasoning").hidden = false;
        view.part("reasoning-text").textContent = view.reasoning;
      }
      for (const text of message.steps || []) view.step(text);
      showAnsweredBy(view, JSON.parse(message.metadata || "{}").chatModel);
      if (message.error) view.fail(message.error.key, message.error.data);
      else view.end(message.status === "streaming" ? "failed" : message.status);
    }
  }
  showConversation();
  refreshChats();
  const views = turnViews();
  if (unanswered || !views.length) {
    state.follow = true;
    scrollToEnd();
  } else {
    // the last question at the top, its answer below it
    state.follow = false;
    const top = views[views.length - 1].el.getBoundingClientRect().top;
    pane.scrollTop += top - pane.getBoundingClientRect().top - 12;
    lastTop = pane.scrollTop;
  }
  if (unanswered) {
    const live = startLive(unanswered, chatId);
    await receive(live, resume);
  }
}

function newChat() {
  detach();
  state.chatId = null;
  clearConversation();
  state.touched.clear();
  applyDefaults();
  $("#topbar-title").textContent = "searchchat";
  if (window.location.hash) history.pushState(null, "", window.location.pathname);
  refreshChats();
  closeDrawer();
  $("#question").focus();
}

async function deleteChat(chatId, title) {
  if (!(await confirmDialog(`Delete “${title}”? Its questions and answers are removed for good.`))) return;
  try {
    const response = await api(withUser(`/api/chats/${chatId}`), { method: "DELETE" });
    if (!response.ok) throw await failureOf(response);
  } catch (error) {
    banner(explain(error.key, error.detail).text);
    return;
  }
  if (chatId === state.chatId) newChat();
  await refreshChats();
  const first = $("#chats .open");
  (first || $("#new-chat")).focus();
}

// ---- attachments -----------------------------------------------------------------------------

function attach(file) {
  const item = { name: file.name, status: "uploading", fileId: null };
  const chip = fileChip(file.name);
  chip.dataset.status = "uploading";
  const bar = document.createElement("progress");
  bar.max = 1;
  bar.value = 0;
  const note = document.createElement("span");
  note.className = "note";
  note.textContent = "uploading…";
  const remove = document.createElement("button");
  remove.type = "button";
  remove.className = "remove";
  remove.textContent = "×";
  remove.setAttribute("aria-label", `Remove ${file.name}`);
  remove.addEventListener("click", () => {
    state.attachments = state.attachments.filter((a) => a !== item);
    chip.remove();
    updateSend();
  });
  chip.append(bar, note, remove);
  item.chip = chip;
  state.attachments.push(item);
  $("#attachments").append(chip);
  updateSend();
  upload(file, (done) => {
    bar.value = done;
    if (done >= 1) note.textContent = "reading…";
  })
    .then((record) => {
      item.status = "ready";
      item.fileId = record.fileId;
      note.textContent = record.pages ? `${record.pages} page${record.pages === 1 ? "" : "s"}` : "ready";
    })
    .catch((error) => {
      item.status = "failed";
      note.textContent = `couldn't attach: ${error.key === "UNREACHABLE" ? "the server is unreachable" : error.detail}`;
    })
    .finally(() => {
      chip.dataset.status = item.status;
      bar.remove();
      updateSend();
    });
}

function clearAttachments() {
  state.attachments = state.attachments.filter((a) => a.status === "uploading");
  for (const chip of $("#attachments").querySelectorAll(".chip")) {
    if (chip.dataset.status !== "uploading") chip.remove();
  }
  updateSend();
}

function updateSend() {
  const uploading = state.attachments.some((a) => a.status === "uploading");
  $("#send").disabled = uploading;
  $("#send").title = uploading ? "Wait until the files are attached" : "Ask (Enter)";
}

// ---- settings, modes, theme --------------------------------------------------------------------

function saveSettings() {
  store.setItem("settings", JSON.stringify(settings));
}

function applyTheme() {
  if (settings.theme === "system") delete document.documentElement.dataset.theme;
  else document.documentElement.dataset.theme = settings.theme;
}

function fillModes(focusModes, optimizationModes) {
  const refill = (select, modes, label) => {
    const kept = select.value; // a choice made before the list came stays made
    select.replaceChildren(...modes.map((mode) => new Option(label(mode), mode)));
    if (modes.includes(kept)) select.value = kept;
  };
  for (const select of [$("#focus"), $("#set-focus")]) refill(select, focusModes, (mode) => FOCUS_LABELS[mode] || mode);
  for (const select of [$("#mode"), $("#set-mode")]) {
    refill(select, optimizationModes, (mode) => mode[0].toUpperCase() + mode.slice(1));
  }
}

function setFocus(mode) {
  const select = $("#focus");
  if (mode && ![...select.options].some((o) => o.value === mode)) select.add(new Option(FOCUS_LABELS[mode] || mode, mode));
  if (mode) select.value = mode;
  updateControls();
}

function applyDefaults() {
  if (!state.touched.has("focus")) setFocus(settings.focus);
  if (!state.touched.has("mode")) $("#mode").value = settings.mode;
  $("#copilot").checked = settings.copilot;
  updateControls();
}

function updateControls() {
  const focus = $("#focus").value;
  $("#copilot").disabled = focus !== "webSearch";
  $("#mode").disabled = !SEARCHING.has(focus);
}

/** The settings' search filters as the chat request's `search` object, or nothing. */
function searchControls() {
  const search = {};
  if (settings.domains.length) search.domains = settings.domains;
  if (settings.recency) search.recency = settings.recency;
  return Object.keys(search).length ? { search } : {};
}

function openSettings() {
  $("#set-domains").value = settings.domains.join(", ");
  $("#set-recency").value = settings.recency;
  $("#set-focus").value = settings.focus;
  $("#set-mode").value = settings.mode;
  $("#set-copilot").checked = settings.copilot;
  $("#set-media").checked = settings.media;
  $("#set-theme").value = settings.theme;
  $("#set-transport").value = settings.transport;
  $("#set-key-row").hidden = !auth.required || auth.accounts;
  $("#set-key-state").textContent = auth.key ? "set" : "not set";
  if (auth.accounts) showKeys();
  $("#settings").showModal();
}

function readSettings() {
  const empty = !document.querySelector("#turns .turn");
  settings.focus = $("#set-focus").value;
  settings.mode = $("#set-mode").value;
  settings.copilot = $("#set-copilot").checked;
  settings.media = $("#set-media").checked;
  settings.domains = $("#set-domains")
    .value.split(/[\s,]+/)
    .map((d) => d.trim())
    .filter(Boolean);
  settings.recency = $("#set-recency").value;
  settings.theme = $("#set-theme").value;
  settings.transport = $("#set-transport").value;
  saveSettings();
  applyTheme();
  if (empty) {
    state.touched.clear(); // a chat not yet begun takes the new defaults
    applyDefaults();
  }
}

// ---- dialogs, drawer, banner --------------------------------------------------------------------

function confirmDialog(text) {
  const dialog = $("#confirm");
  $("#confirm-text").textContent = text;
  dialog.returnValue = "";
  dialog.showModal();
  $("#confirm-cancel").focus();
  return new Promise((resolve) => {
    dialog.addEventListener("close", () => resolve(dialog.returnValue === "ok"), { once: true });
  });
}

auth.askForKey = (why) => {
  const dialog = $("#key-dialog");
  $("#key-reason").textContent =
    why === "rejected"
      ? "That API key was not accepted. Check it and enter it again."
      : "This server needs an API key. Ask whoever runs it for one.";
  $("#key-input").value = "";
  dialog.returnValue = "";
  dialog.showModal();
  return new Promise((resolve) => {
    dialog.addEventListener(
      "close",
      () => {
        const key = $("#key-input").value.trim();
        const ok = dialog.returnValue === "ok" && Boolean(key);
        if (ok) {
          setKey(key);
          socket.ws?.close(); // the next socket carries the new key
          banner(null);
        }
        resolve(ok);
      },
      { once: true },
    );
  });
};

const phone = window.matchMedia("(max-width: 720px)");

function openDrawer() {
  document.body.classList.add("drawer-open");
  $("#sidebar").inert = false;
  $("#backdrop").hidden = false;
  $("#open-drawer").setAttribute("aria-expanded", "true");
  ($("#chats li.active .open") || $("#new-chat")).focus();
}

function closeDrawer() {
  if (!document.body.classList.contains("drawer-open")) return;
  document.body.classList.remove("drawer-open");
  $("#sidebar").inert = phone.matches;
  $("#backdrop").hidden = true;
  $("#open-drawer").setAttribute("aria-expanded", "false");
}

function banner(text, action = null) {
  const box = $("#banner");
  box.replaceChildren();
  box.hidden = !text;
  if (!text) return;
  box.append(text);
  if (action) {
    const control = button("primary", action.label, null);
    control.addEventListener("click", action.run);
    box.append(" ", control);
  }
}

// ---- start ---------------------------------------------------------------------------------------

async function loadConfig() {
  try {
    state.config = await getJson("/api/config");
  } catch (error) {
    const retry = { label: "Try again", run: () => start() };
    if (error.key === "UNAUTHORIZED") banner(explain("UNAUTHORIZED").text, { label: "Enter API key", run: () => start() });
    else banner(explain(error.key, error.detail).text, retry);
    return false;
  }
  banner(null);
  auth.required = Boolean(state.config.authRequired);
  site.searchProvider = state.config.searchProvider || "";
  $("#demo-notice").hidden = !state.config.demo;
  const modelProblem = state.config.demo ? null : state.config.modelProblem;
  $("#model-off").hidden = !modelProblem;
  $("#model-off").textContent = modelProblem
    ? `Questions cannot be answered on this server yet: ${sentence(modelProblem)}`
    : "";
  const problem = state.config.demo ? null : state.config.searchProblem;
  $("#search-off").hidden = !problem;
  $("#search-off").textContent = problem
    ? `Web search will not work on this server: ${sentence(problem)} Answers will have no web sources. ${searchFix(problem)}`
    : "";
  fillModes(state.config.focusModes || Object.keys(FOCUS_LABELS), state.config.optimizationModes || ["speed"]);
  fillServers(state.config.mcpServers || []);
  return true;
}

/** The source picker's MCP servers: a server used by default is always on; another is
 * used when ticked (`sources: ["mcp:<name>"]`). */
function fillServers(servers) {
  const box = $("#mcp-servers");
  const ticked = new Set(chosenServers().sources || []);
  box.replaceChildren(
    ...servers.map((server) => {
      const label = document.createElement("label");
      label.className = "toggle";
      label.title = server.default
        ? `The research uses the tools of ${server.name} (MCP) when it needs them`
        : `Let the research use the tools of ${server.name} (MCP)`;
      const input = document.createElement("input");
      input.type = "checkbox";
      input.value = `mcp:${server.name}`;
      input.checked = server.default || ticked.has(input.value);
      input.disabled = server.default;
      label.append(input, ` ${server.name}`);
      return label;
    }),
  );
  box.hidden = servers.length === 0;
}

/** The ticked MCP servers not used by default, as the request's `sources`. */
function chosenServers() {
  const named = [...document.querySelectorAll("#mcp-servers input:checked:not(:disabled)")].map((i) => i.value);
  return named.length ? { sources: named } : {};
}

/** With accounts: signed in (the sign-in page until then), named in the sidebar. */
async function signedIn() {
  let who;
  try {
    who = await whoAmI();
  } catch (error) {
    banner(explain(error.key, error.detail).text, { label: "Try again", run: () => start() });
    return false;
  }
  if (who.mode !== "accounts") {
    if (window.location.pathname === "/signin") history.replaceState(null, "", "/");
    return true;
  }
  auth.accounts = true;
  auth.required = true; // the session decides the user: the page names none
  auth.askForKey = signInAgain;
  const user = who.user || (await showSignIn(who));
  showAccount(user);
  const refused = /^#signin-error=(.*)$/.exec(window.location.hash);
  if (refused) {
    history.replaceState(null, "", "/");
    state.notice = decodeURIComponent(refused[1]); // shown once the page is up
  }
  if (window.location.pathname === "/signin") {
    window.location.assign(nextAfterSignIn()); // whatever serves that path (this page, or another UI)
    return false;
  }
  return true;
}

async function start() {
  if (!(await signedIn())) return;
  if (!(await loadConfig())) return;
  await loadModels($("#model"));
  if (state.notice) banner(state.notice);
  state.notice = null;
  applyDefaults();
  await refreshChats();
  route();
}

function wire() {
  $("#ask").addEventListener("submit", (event) => {
    event.preventDefault();
    const question = $("#question").value.trim();
    if (!question || state.turn || $("#send").disabled) return;
    $("#question").value = "";
    resizeQuestion();
    ask(question);
  });
  $("#question").addEventListener("keydown", (event) => {
    if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
      event.preventDefault();
      $("#ask").requestSubmit();
    }
  });
  $("#question").addEventListener("input", resizeQuestion);
  $("#stop").addEventListener("click", stop);
  $("#new-chat").addEventListener("click", newChat);
  $("#new-chat-top").addEventListener("click", newChat);
  $("#focus").addEventListener("change", () => {
    state.touched.add("focus");
    updateControls();
  });
  $("#mode").addEventListener("change", () => state.touched.add("mode"));
  $("#attach").addEventListener("click", () => $("#file-input").click());
  $("#file-input").addEventListener("change", (event) => {
    for (const file of event.target.files) attach(file);
    event.target.value = "";
  });
  $("#open-settings").addEventListener("click", () => {
    closeDrawer();
    openSettings();
  });
  $("#settings").addEventListener("change", readSettings);
  $("#set-key-change").addEventListener("click", async () => {
    if (await auth.askForKey("needed")) $("#set-key-state").textContent = "set";
  });
  $("#set-key-forget").addEventListener("click", () => {
    setKey("");
    $("#set-key-state").textContent = "not set";
  });
  $("#confirm-cancel").addEventListener("click", () => $("#confirm").close("cancel"));
  $("#key-cancel").addEventListener("click", () => $("#key-dialog").close("cancel"));
  $("#open-drawer").addEventListener("click", openDrawer);
  $("#backdrop").addEventListener("click", closeDrawer);
  $("#sidebar").inert = phone.matches;
  phone.addEventListener("change", () => {
    closeDrawer();
    $("#sidebar").inert = phone.matches;
  });
  document.addEventListener("keydown", (event) => {
    if (event.key !== "Escape" || document.querySelector("dialog[open]")) return;
    if (document.body.classList.contains("drawer-open")) closeDrawer();
    else if (state.turn) stop();
  });
  window.addEventListener("hashchange", route);
}

function resizeQuestion() {
  const box = $("#question");
  box.style.height = "auto";
  box.style.height = `${Math.min(box.scrollHeight + 2, phone.matches ? 120 : 200)}px`;
}

applyTheme();
applyDefaults(); // the saved choices from the first paint, not the page's own until the config arrives
wire();
start();
