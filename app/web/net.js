// Talking to the server: requests with the API key, who the user is, SSE read from a
// streaming fetch, the WebSocket, uploads with progress, and errors in plain words.

const store = window.localStorage;

export const auth = {
  key: store.getItem("apiKey") || "",
  // with accounts the session cookie says who this is; a refusal shows the sign-in page
  accounts: false,
  // with auth on the key decides the user: the page must not name one (PROTOCOL §7)
  required: Boolean(store.getItem("apiKey")),
  userId: store.getItem("userId") || randomId(),
  askForKey: async () => false, // set by the page: shows the key dialog
};
store.setItem("userId", auth.userId);

export function randomId() {
  // a positive 62-bit decimal id, as the server's ids are
  const words = crypto.getRandomValues(new Uint32Array(2));
  return ((BigInt(words[0] & 0x3fffffff) << 32n) | BigInt(words[1])).toString();
}

export function setKey(key) {
  auth.key = key;
  if (key) store.setItem("apiKey", key);
  else store.removeItem("apiKey");
}

/** The userId to send: none when auth is on. */
export function me() {
  return auth.required ? null : auth.userId;
}

export function withUser(path) {
  const user = me();
  if (!user) return path;
  return `${path}${path.includes("?") ? "&" : "?"}userId=${encodeURIComponent(user)}`;
}

export function withUserBody(body) {
  const user = me();
  return user ? { ...body, userId: user } : body;
}

function headers(extra = {}) {
  const out = { ...extra };
  if (auth.key) out.Authorization = `Bearer ${auth.key}`;
  return out;
}

/** A failure, with a `key` as the server's error keys (plus UNREACHABLE and LOST). */
export class Failure extends Error {
  constructor(key, detail = "", status = 0, retryAfter = 0) {
    super(detail || key);
    this.key = key;
    this.detail = detail;
    this.status = status;
    this.retryAfter = retryAfter;
  }
}

let keyPrompt = null; // one key dialog at a time, however many requests were refused

async function needKey() {
  auth.required = true;
  if (!keyPrompt) {
    keyPrompt = auth.askForKey(auth.key ? "rejected" : "needed").finally(() => (keyPrompt = null));
  }
  return keyPrompt;
}

/** fetch() with the key; a 401 asks for a key and tries again. Network failures
 * throw `Failure("UNREACHABLE")`, an abort throws the AbortError. */
export async function api(path, options = {}) {
  for (;;) {
    let response;
    try {
      response = await fetch(path, { ...options, headers: headers(options.headers) });
    } catch (error) {
      if (error.name === "AbortError") throw error;
      throw new Failure("UNREACHABLE", String(error));
    }
    if (response.status === 401 && (await needKey())) continue;
    return response;
  }
}

/** The failure a non-2xx response describes ({"type":"error","key","data"}). */
export async function failureOf(response) {
  const body = await response.json().catch(() => ({}));
  const retryAfter = Number(response.headers.get("Retry-After")) || 0;
  let key = body.key || (response.status >= 500 ? "INTERNAL" : "BAD_REQUEST");
  if (response.status === 409) key = "BUSY";
  if (response.status === 503 && key === "INTERNAL") key = "UNAVAILABLE";
  return new Failure(key, body.data || response.statusText, response.status, retryAfter);
}

export async function getJson(path, options = {}) {
  const response = await api(path, options);
  if (!response.ok) throw await failureOf(response);
  return response.json();
}

export function postJson(path, body, options = {}) {
  return getJson(path, {
    ...options,
    method: "POST",
    headers: { "Content-Type": "application/json" },
    body: JSON.stringify(withUserBody(body)),
  });
}

/** Reads an SSE body, calling onEvent(json, id) per event, until it ends. */
export async function readSse(response, onEvent) {
  const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += value.replace(/\r\n?/g, "\n");
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

/** The WebSocket, opened on first use: frames go to `onFrame`, a close to `onClose`. */
export class Socket {
  constructor(onFrame, onClose) {
    this.onFrame = onFrame;
    this.onClose = onClose;
    this.ws = null;
  }

  /** The open socket; rejects with Failure("UNREACHABLE") when it cannot open. */
  open() {
    if (this.ws && this.ws.readyState === WebSocket.OPEN) return Promise.resolve(this.ws);
    if (this.opening) return this.opening;
    const scheme = window.location.protocol === "https:" ? "wss:" : "ws:";
    const token = auth.key ? `?token=${encodeURIComponent(auth.key)}` : "";
    const ws = new WebSocket(`${scheme}//${window.location.host}/api/chat/ws${token}`);
    this.opening = new Promise((resolve, reject) => {
      ws.addEventListener("open", () => resolve(ws), { once: true });
      ws.addEventListener("close", () => reject(new Failure("UNREACHABLE", "the WebSocket did not open")), {
        once: true,
      });
    }).finally(() => (this.opening = null));
    ws.addEventListener("message", (message) => this.onFrame(JSON.parse(message.data), ws));
    ws.addEventListener("close", (event) => {
      if (this.ws === ws) this.ws = null;
      this.onClose(event.code, ws);
    });
    this.ws = ws;
    return this.opening;
  }

  async send(frame) {
    const ws = await this.open();
    ws.send(JSON.stringify(frame));
  }
}

/** POST /api/uploads with one file, reporting progress (0–1); resolves to the
 * server's file record, rejects with a Failure. */
export function upload(file, onProgress) {
  return new Promise((resolve, reject) => {
    const form = new FormData();
    form.append("files", file, file.name);
    const user = me();
    if (user) form.append("userId", user);
    const xhr = new XMLHttpRequest();
    xhr.open("POST", "/api/uploads");
    if (auth.key) xhr.setRequestHeader("Authorization", `Bearer ${auth.key}`);
    xhr.upload.addEventListener("progress", (event) => {
      if (event.lengthComputable) onProgress(event.loaded / event.total);
    });
    xhr.addEventListener("load", () => {
      let body = {};
      try {
        body = JSON.parse(xhr.responseText);
      } catch {
        // not JSON: the status says enough
      }
      if (xhr.status >= 200 && xhr.status < 300 && body.files && body.files[0]) resolve(body.files[0]);
      else reject(new Failure(body.key || "BAD_REQUEST", body.data || `the server answered ${xhr.status}`, xhr.status));
    });
    xhr.addEventListener("error", () => reject(new Failure("UNREACHABLE", "the upload did not reach the server")));
    xhr.send(form);
  });
}

/** What went wrong, for a person: {text, action?} ("key" asks for an API key). */
/** `text` as a sentence: with a full stop, unless it ends with its own (a server's
 * "…is this server offline?" keeps its question mark). */
export function sentence(text) {
  const said = String(text).trim();
  return /[.!?…]$/.test(said) ? said : `${said}.`;
}

export function explain(key, detail = "", retryAfter = 0) {
  const wait = retryAfter ? ` in ${retryAfter} s` : " in a minute";
  switch (key) {
    case "UNREACHABLE":
      return { text: "Can't reach the server. Check that it is running and that you are online, then try again." };
    case "LOST":
      return { text: "The server stopped while writing this answer, so it is incomplete." };
    case "UNAUTHORIZED":
      if (auth.accounts) return { text: "You are signed out. Sign in again to go on.", action: "key" };
      return { text: "This server needs a valid API key.", action: "key" };
    case "FORBIDDEN":
      if (auth.accounts) return { text: "You are not allowed to do this (the chat may belong to someone else)." };
      return { text: "Your API key is not allowed to do this (the chat may belong to someone else)." };
    case "RATE_LIMITED":
      if (/daily token quota/i.test(detail)) {
        return { text: "You have used today's share of answers on this server. It renews at midnight UTC." };
      }
      return { text: `Too many questions in a short time. Try again${wait}.` };
    case "BUSY":
      return { text: "This chat is still answering another question. Wait for it to finish, then try again." };
    case "UNAVAILABLE":
      return { text: "The server is busy or restarting. Try again in a moment." };
    case "CONFIG_ERROR":
      return { text: "The server has no AI model set up (LLM_API_KEY). Whoever runs it needs to configure one." };
    case "CHAT_ERROR":
      if (/refused the connection|does not resolve|secure connection/i.test(detail)) {
        return { text: "The server cannot reach its AI model: it is not set up right (its address). Whoever runs the server needs to check LLM_BASE_URL." };
      }
      return { text: "The AI model could not be reached. Try again in a moment." };
    case "STREAM_ERROR":
      if (/generation lost/i.test(detail)) return explain("LOST");
      if (/did not finish within|timed out|no token/i.test(detail)) return { text: "The AI model took too long to answer. Try again." };
      if (/(answered |\()(401|403)\b|API key/.test(detail)) return { text: "The AI model refused the server's key. Whoever runs the server needs to check LLM_API_KEY." };
      if (/(answered |\()429\b|rate limiting/.test(detail)) return { text: "The AI model is rate-limiting this server. Try again in a minute." };
      if (/(answered |\()\d{3}\b/.test(detail)) return { text: "The AI model returned an error instead of an answer. Try again in a moment." };
      if (/empty answer/.test(detail)) return { text: "The AI model sent an empty answer. Try again." };
      return { text: "The AI model stopped answering partway through. Try again." };
    case "SEARCH_ERROR":
      return { text: "The web search failed. Try again, or turn web search off." };
    case "NOT_FOUND":
      return { text: "That chat no longer exists." };
    case "BAD_REQUEST":
      return { text: `The server could not take this question: ${sentence(detail || "it was not valid")}` };
    default:
      return { text: "Something went wrong on the server. Try again." };
  }
}
