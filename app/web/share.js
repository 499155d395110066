// Share links and exports (PROTOCOL §15): share the open chat (the link is made, copied
// with the Clipboard API and shown), take a link back, list the user's shared chats, and
// download the chat as Markdown, JSON or HTML. The open chat is the one in the address
// (#chat=<id>), so this file needs nothing of app.js.
import { api, auth, explain, failureOf, getJson, withUser, withUserBody } from "./net.js";

const $ = (selector) => document.querySelector(selector);

function openChatId() {
  const match = /^#chat=([A-Za-z0-9_-]{1,64})$/.exec(window.location.hash);
  return match ? match[1] : null;
}

function say(text) {
  const notice = $("#share-notice");
  notice.textContent = text;
  notice.hidden = !text;
}

function problem(error) {
  return explain(error.key, error.detail).text;
}

async function call(path, method, body) {
  const options = { method };
  if (body !== undefined) {
    options.headers = { "Content-Type": "application/json" };
    options.body = JSON.stringify(withUserBody(body));
  }
  const response = await api(method === "POST" ? path : withUser(path), options);
  if (!response.ok) throw await failureOf(response);
  return response.status === 204 ? null : response.json();
}

async function copy(text) {
  try {
    await navigator.clipboard.writeText(text);
    return true;
  } catch {
    return false; // no clipboard here (an insecure origin, or refused): the link is shown
  }
}

async function shareChat() {
  const chatId = openChatId();
  if (!chatId) return say("Ask something first: there is no chat to share yet.");
  const body = {};
  const name = $("#share-name").value.trim();
  if (name) body.displayName = name;
  $("#share-create").disabled = true;
  try {
    const made = await call(`/api/chats/${chatId}/share`, "POST", body);
    $("#share-url").value = made.url;
    $("#share-link").hidden = false;
    say((await copy(made.url)) ? "Link copied. Anyone with it can read this chat as it is now." : "Copy the link below. Anyone with it can read this chat as it is now.");
    await listShares();
  } catch (error) {
    say(problem(error));
  } finally {
    $("#share-create").disabled = false;
  }
}

async function unshare(chatId) {
  try {
    await call(`/api/chats/${chatId}/share`, "DELETE");
    if (chatId === openChatId()) $("#share-link").hidden = true;
    say("The link no longer works.");
    await listShares();
  } catch (error) {
    say(problem(error));
  }
}

async function listShares() {
  const list = $("#share-list");
  let shares = [];
  try {
    shares = (await getJson(withUser("/api/shares"))).shares;
  } catch (error) {
    list.replaceChildren(item(problem(error)));
    return;
  }
  if (!shares.length) {
    list.replaceChildren(item("You have shared no chat."));
    return;
  }
  list.replaceChildren(
    ...shares.map((share) => {
      const li = document.createElement("li");
      const link = document.createElement("a");
      link.href = share.url;
      link.target = "_blank";
      link.rel = "noopener noreferrer";
      link.textContent = share.title || share.url;
      const when = document.createElement("span");
      when.className = "hint";
      when.textContent = ` ${new Date(share.updatedAt).toLocaleDateString()}`;
      const stop = document.createElement("button");
      stop.type = "button";
      stop.textContent = "Unshare";
      stop.onclick = () => unshare(share.chatId);
      li.append(link, when, " ", stop);
      return li;
    }),
  );
}

function item(text) {
  const li = document.createElement("li");
  li.className = "hint";
  li.textContent = text;
  return li;
}

/** Downloads the open chat: fetched with the key (a plain link would not carry it). */
async function download(format) {
  const chatId = openChatId();
  if (!chatId) return say("Ask something first: there is no chat to export yet.");
  try {
    const response = await api(withUser(`/api/chats/${chatId}/export?format=${format}`));
    if (!response.ok) throw await failureOf(response);
    const disposition = response.headers.get("Content-Disposition") || "";
    const starred = /filename\*=UTF-8''([^;]+)/.exec(disposition);
    const plain = /filename="([^"]+)"/.exec(disposition);
    const name = starred ? decodeURIComponent(starred[1]) : plain ? plain[1] : `chat.${format}`;
    const url = URL.createObjectURL(await response.blob());
    const anchor = document.createElement("a");
    anchor.href = url;
    anchor.download = name;
    document.body.append(anchor);
    anchor.click();
    anchor.remove();
    setTimeout(() => URL.revokeObjectURL(url), 10000);
  } catch (error) {
    say(problem(error));
  }
}

function open() {
  const chatId = openChatId();
  say(chatId ? "" : "Open a chat to share or export it.");
  $("#share-link").hidden = true;
  $("#share-name-row").hidden = !auth.accounts;
  for (const button of document.querySelectorAll("#share-create, #share-dialog [data-format]")) {
    button.disabled = !chatId;
  }
  $("#share-dialog").showModal();
  listShares();
}

function setUp() {
  $("#open-share").onclick = open;
  $("#share-create").onclick = shareChat;
  $("#share-copy").onclick = async () => {
    const url = $("#share-url").value;
    if (await copy(url)) say("Link copied.");
    else $("#share-url").select();
  };
  for (const button of document.querySelectorAll("#share-dialog [data-format]")) {
    button.onclick = () => download(button.dataset.format);
  }
}

setUp();
