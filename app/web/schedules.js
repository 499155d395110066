// Research on a schedule (PROTOCOL §16) in the web client: "Run this every…" under a
// question, a Schedules dialog (next run, last runs, pause/resume, run now, delete), and a
// dot on the chats of schedules that ran since the chat was last opened in this browser
// (each schedule's lastRunAt against a per-chat "seen" time kept in localStorage).
import { api, failureOf, getJson, postJson, withUser, withUserBody } from "./net.js";

const $ = (selector) => document.querySelector(selector);
const SEEN = "scheduleSeen";
const zone = Intl.DateTimeFormat().resolvedOptions().timeZone || "UTC";
const PRESETS = {
  hourly: () => "0 * * * *",
  daily: (hour, minute) => `${minute} ${hour} * * *`,
  weekdays: (hour, minute) => `${minute} ${hour} * * 1-5`,
};
let schedules = [];

function el(tag, props = {}, ...children) {
  const node = Object.assign(document.createElement(tag), props);
  node.append(...children);
  return node;
}

function when(iso) {
  return iso ? new Date(iso).toLocaleString([], { dateStyle: "medium", timeStyle: "short" }) : "—";
}

function seen() {
  return JSON.parse(localStorage.getItem(SEEN) || "{}");
}

function markSeen(chatId) {
  const marks = seen();
  marks[chatId] = new Date().toISOString();
  localStorage.setItem(SEEN, JSON.stringify(marks));
}

async function send(path, method, body = null) {
  const options = { method };
  if (body !== null) {
    options.headers = { "Content-Type": "application/json" };
    options.body = JSON.stringify(withUserBody(body));
  }
  const response = await api(withUser(path), options);
  if (!response.ok) throw await failureOf(response);
  return response.json();
}

async function load() {
  try {
    ({ schedules } = await getJson(withUser("/api/schedules")));
  } catch {
    schedules = [];
  }
  markChats();
}

/** The dot on a chat whose schedule ran since the chat was last opened here. */
function markChats() {
  const marks = seen();
  const current = /^#chat=(.+)$/.exec(window.location.hash)?.[1];
  for (const schedule of schedules) {
    const item = document.querySelector(`#chats li[data-chat-id="${CSS.escape(schedule.chatId)}"]`);
    if (!item) continue;
    if (schedule.chatId === current && schedule.lastRunAt) markSeen(schedule.chatId);
    const unread =
      schedule.chatId !== current &&
      schedule.lastRunAt &&
      (!marks[schedule.chatId] || marks[schedule.chatId] < schedule.lastRunAt);
    item.classList.toggle("unread", Boolean(unread));
    item.title = unread ? "New run since you last looked" : "";
  }
}

// ---- "Run this every…" ---------------------------------------------------------------

function addActions() {
  for (const turn of document.querySelectorAll("#turns .turn")) {
    const bar = turn.querySelector(".actions");
    if (!bar || bar.querySelector(".schedule-it")) continue;
    const question = turn.turnView?.question || turn.querySelector(".question")?.textContent;
    if (!question) continue;
    const action = el("button", { type: "button", className: "schedule-it", title: "Ask this again on a schedule" });
    action.append(el("span", { className: "label", textContent: "Run this every…" }));
    action.addEventListener("click", () => openDialog(question));
    bar.append(action);
  }
}

// ---- the dialog ------------------------------------------------------------------------

function dialog() {
  let box = $("#schedules");
  if (box) return box;
  box = el("dialog", { id: "schedules", className: "wide" });
  box.setAttribute("aria-labelledby", "schedules-title");
  const form = el("form", { method: "dialog" });
  form.append(
    el("h2", { id: "schedules-title", textContent: "Schedules" }),
    el("p", { id: "schedules-error", className: "notice", hidden: true }),
    el("section", { id: "schedule-new", hidden: true }),
    el("ul", { id: "schedule-list" }),
    el("menu", {}, el("button", { className: "primary", value: "done", textContent: "Done" })),
  );
  box.append(form);
  document.body.append(box);
  return box;
}

function showError(text) {
  const error = $("#schedules-error");
  error.textContent = text || "";
  error.hidden = !text;
}

function newForm(question) {
  const section = $("#schedule-new");
  section.replaceChildren();
  section.hidden = !question;
  if (!question) return;
  const preset = el(
    "select",
    { id: "schedule-preset" },
    el("option", { value: "daily", textContent: "Every day at" }),
    el("option", { value: "weekdays", textContent: "Every weekday at" }),
    el("option", { value: "hourly", textContent: "Every hour" }),
  );
  const time = el("input", { id: "schedule-time", type: "time", value: "08:00", required: true });
  preset.addEventListener("change", () => (time.hidden = preset.value === "hourly"));
  const notify = el(
    "select",
    { id: "schedule-notify" },
    el("option", { value: "always", textContent: "after every run" }),
    el("option", { value: "changed", textContent: "only when the answer changed" }),
  );
  const hook = el("input", { id: "schedule-webhook", type: "url", placeholder: "https://… (optional)" });
  const secret = el("p", { id: "schedule-secret", className: "notice", hidden: true });
  const create = el("button", { type: "button", className: "primary", textContent: "Create schedule" });
  create.addEventListener("click", async () => {
    const [hour, minute] = (time.value || "08:00").split(":").map(Number);
    const body = {
      question,
      cron: PRESETS[preset.value](hour, minute),
      timezone: zone,
      focusMode: $("#focus")?.value || "webSearch",
      optimizationMode: $("#mode")?.value || "speed",
      notify: notify.value,
    };
    if (hook.value.trim()) body.webhook = { url: hook.value.trim() };
    try {
      const { schedule } = await postJson("/api/schedules", body);
      showError("");
      if (schedule.webhook?.secret) {
        secret.textContent = `Webhook signing secret (shown only this once): ${schedule.webhook.secret}`;
        secret.hidden = false;
        create.disabled = true;
      } else {
        section.hidden = true;
      }
      await refresh();
    } catch (failure) {
      showError(failure.detail || String(failure));
    }
  });
  section.append(
    el("p", { className: "hint", textContent: `“${question}”, in ${zone} time` }),
    el("div", { className: "row" }, preset, time),
    el("label", {}, "Tell me ", notify),
    el("label", {}, "Webhook ", hook),
    el("div", { className: "row" }, create),
    secret,
  );
}

async function refresh() {
  await load();
  const list = $("#schedule-list");
  if (!list) return;
  list.replaceChildren();
  if (!schedules.length) list.append(el("li", { className: "hint", textContent: "No schedules yet." }));
  for (const schedule of schedules) list.append(item(schedule));
}

function item(schedule) {
  const row = el("li", { className: "schedule" });
  row.dataset.scheduleId = schedule.id;
  const state = schedule.enabled ? `next ${when(schedule.nextRunAt)}` : `paused${schedule.pausedReason ? `: ${schedule.pausedReason}` : ""}`;
  const open = el("a", { href: `#chat=${schedule.chatId}`, textContent: schedule.question });
  open.addEventListener("click", () => $("#schedules").close());
  const runs = el("ul", { className: "runs" });
  const actions = el("div", { className: "row" });
  const act = (label, run) => {
    const control = el("button", { type: "button", textContent: label });
    control.addEventListener("click", async () => {
      try {
        await run();
        showError("");
        await refresh();
      } catch (failure) {
        showError(failure.detail || String(failure));
      }
    });
    actions.append(control);
  };
  const path = `/api/schedules/${schedule.id}`;
  act(schedule.enabled ? "Pause" : "Resume", () => send(path, "PATCH", { enabled: !schedule.enabled }));
  act("Run now", () => send(`${path}/run`, "POST", {}));
  act("Delete", () => send(path, "DELETE"));
  row.append(open, el("span", { className: "hint", textContent: ` ${schedule.cron} (${schedule.timezone}) · ${state}` }), actions, runs);
  getJson(withUser(`${path}/runs`))
    .then(({ runs: found }) => {
      for (const run of found.slice(0, 5)) {
        const changed = run.changed === null ? "" : run.changed ? " · changed" : " · unchanged";
        const retry = run.retry ? " · retried" : "";
        runs.append(el("li", { className: "hint", textContent: `${when(run.startedAt)}: ${run.status}${changed}${retry}${run.error ? ` (${run.error})` : ""}` }));
      }
    })
    .catch(() => {});
  return row;
}

async function openDialog(question = null) {
  const box = dialog();
  showError("");
  newForm(question);
  await refresh();
  if (!box.open) box.showModal();
}

function install() {
  const footer = $("#sidebar footer");
  if (footer && !$("#open-schedules")) {
    const open = el("button", { id: "open-schedules", type: "button", className: "plain", textContent: "Schedules" });
    open.addEventListener("click", () => openDialog());
    footer.prepend(open);
  }
  new MutationObserver(addActions).observe($("#turns"), { childList: true, subtree: true });
  // the schedules are asked for once the chat list shows (so after any sign-in), then
  // every minute while it does
  let loaded = false;
  const listed = () => document.querySelector("#chats li") !== null;
  new MutationObserver(() => {
    if (!loaded && listed()) {
      loaded = true;
      load();
    } else {
      markChats();
    }
  }).observe($("#chats"), { childList: true });
  window.addEventListener("hashchange", markChats);
  setInterval(() => listed() && load(), 60_000);
}

install();
