// Accounts in the web client: who is signed in (GET /api/auth/me), the sign-in page
// (password, "Sign in with …" when the server has an identity provider, sign-up when
// it allows), sign-out, the user's API keys in settings (made, copied once, revoked),
// and the admin's users (roles, enabled, quotas, usage, invites).
import { api, auth, Failure, failureOf, getJson, sentence } from "./net.js";

const $ = (selector) => document.querySelector(selector);

/** What the server says of the visitor: {mode, user, methods, signup, oidc}. With auth
 * off `user` is null and nothing needs signing in. */
export async function whoAmI() {
  let response;
  try {
    response = await fetch("/api/auth/me", {
      headers: auth.key ? { Authorization: `Bearer ${auth.key}` } : {},
    });
  } catch (error) {
    throw new Failure("UNREACHABLE", String(error));
  }
  const body = await response.json().catch(() => ({}));
  if (response.status === 401 || response.ok) {
    return {
      mode: body.authMode || (response.status === 401 ? "keys" : "off"),
      user: response.ok ? body.user : null,
      methods: body.authMethods || [],
      signup: body.signup || "closed",
      oidc: body.oidc || null,
    };
  }
  throw new Failure(body.key || (response.status >= 500 ? "INTERNAL" : "BAD_REQUEST"), body.data || "", response.status);
}

// ---- the sign-in page ---------------------------------------------------------------------

/** Where /signin?next= sends the browser once signed in: a path of this site, never
 * another one (a UI served beside this client behind the same proxy, say). */
export function nextAfterSignIn() {
  const next = new URLSearchParams(window.location.search).get("next") || "/";
  return /^\/(?![/\\])/.test(next) ? next : "/";
}

let signingIn = null; // one sign-in page at a time, however many requests were refused
let current = null; // what whoAmI said last

/** Shows the sign-in page until the visitor is signed in; resolves to the user. */
export function showSignIn(who, message = "") {
  current = who;
  if (signingIn) return signingIn;
  signingIn = new Promise((resolve) => {
    const page = $("#signin");
    let creating = false;
    const fromAddress = /^#signin-error=(.*)$/.exec(window.location.hash);
    if (fromAddress) {
      message = decodeURIComponent(fromAddress[1]);
      history.replaceState(null, "", window.location.pathname);
    }
    const mayCreate = who.signup !== "closed";
    // an invite link (/signin?invite=…) opens "Create your account" with its code
    const invited = new URLSearchParams(window.location.search).get("invite");
    if (invited && who.signup === "invite") {
      creating = true;
      $("#signin-invite").value = invited;
    }
    const draw = () => {
      $("#signin-title").textContent = creating ? "Create your account" : "Sign in";
      $("#signin-submit").textContent = creating ? "Create account" : "Sign in";
      $("#signin-name-row").hidden = !creating;
      $("#signin-invite-row").hidden = !(creating && who.signup === "invite");
      $("#signin-rule").hidden = !(creating && who.signup === "invite");
      $("#signin-rule").textContent = who.oidc
        ? `Accounts here are by invitation: enter the admin's code, then create your account or sign in with ${who.oidc.name}.`
        : "Accounts here are by invitation: ask the admin for a code.";
      $("#signin-password").autocomplete = creating ? "new-password" : "current-password";
      $("#signin-password").minLength = creating ? 10 : 0;
      $("#signin-switch").hidden = !mayCreate;
      $("#signin-switch-text").textContent = creating ? "Have an account?" : "New here?";
      $("#signin-toggle").textContent = creating ? "Sign in" : "Create an account";
    };
    const error = (text) => {
      $("#signin-error").hidden = !text;
      $("#signin-error").textContent = text || "";
    };
    const oidc = $("#signin-oidc");
    oidc.hidden = !who.oidc;
    $("#signin-or").hidden = !who.oidc;
    if (who.oidc) {
      oidc.textContent = `Sign in with ${who.oidc.name}`;
      const next = window.location.pathname === "/signin" ? nextAfterSignIn() : window.location.pathname + window.location.hash;
      const login = `${who.oidc.login}?next=${encodeURIComponent(next)}`;
      oidc.href = login;
      // a new account through the provider spends the invite code typed here
      oidc.onclick = () => {
        const code = who.signup === "invite" ? $("#signin-invite").value.trim() : "";
        oidc.href = code ? `${login}&invite=${encodeURIComponent(code)}` : login;
      };
    }
    $("#signin-toggle").onclick = () => {
      creating = !creating;
      error("");
      draw();
    };
    $("#signin-form").onsubmit = async (event) => {
      event.preventDefault();
      const body = { email: $("#signin-email").value.trim(), password: $("#signin-password").value };
      if (creating) {
        body.name = $("#signin-name").value.trim() || undefined;
        if (who.signup === "invite") body.invite = $("#signin-invite").value.trim() || undefined;
      }
      $("#signin-submit").disabled = true;
      try {
        const response = await fetch(creating ? "/api/auth/signup" : "/api/auth/login", {
          method: "POST",
          headers: { "Content-Type": "application/json" },
          body: JSON.stringify(body),
        });
        const answer = await response.json().catch(() => ({}));
        if (!response.ok) {
          const wait = Number(response.headers.get("Retry-After")) || 0;
          error(words(response.status, answer.data, wait));
          return;
        }
        $("#signin-password").value = "";
        error("");
        page.hidden = true;
        signingIn = null;
        resolve(answer.user);
      } catch {
        error("Can't reach the server. Check that you are online, then try again.");
      } finally {
        $("#signin-submit").disabled = false;
      }
    };
    draw();
    error(message);
    page.hidden = false;
    $("#signin-email").focus();
  });
  return signingIn;
}

function words(status, detail, wait) {
  if (status === 401 && /disabled/.test(detail || "")) return "This account is disabled. Ask the server's admin.";
  if (status === 401) return "That email and password don't match an account here.";
  if (status === 429) return `Too many tries. Try again in ${Math.ceil(wait / 60) || 1} min.`;
  if (status === 409) return "There is already an account with this email: sign in instead.";
  return detail ? sentence(`${detail[0].toUpperCase()}${detail.slice(1)}`) : "That did not work. Try again.";
}

/** A request was refused for want of a session (it ended, the account was disabled):
 * the sign-in page again; resolves to true once signed in. */
export async function signInAgain() {
  const who = current || (await whoAmI());
  await showSignIn(who, "Your session has ended. Sign in again to go on.");
  return true;
}

// ---- who is signed in, signing out ---------------------------------------------------------------

export function showAccount(user) {
  $("#account").hidden = !user;
  if (!user) return;
  $("#account-name").textContent = user.name && user.email ? `${user.name} · ${user.email}` : user.name || user.email || "";
  $("#open-admin").hidden = user.role !== "admin";
  $("#sign-out").onclick = async () => {
    try {
      await fetch("/api/auth/logout", { method: "POST" });
    } catch {
      // the server is away: the page forgets the session anyway
    }
    window.location.assign("/");
  };
  $("#open-admin").onclick = openAdmin;
}

// ---- API keys, in the settings -------------------------------------------------------------------

export async function showKeys() {
  $("#keys").hidden = false;
  $("#key-new").hidden = true;
  $("#key-create").onclick = createKey;
  $("#key-name").onkeydown = (event) => {
    if (event.key === "Enter") {
      event.preventDefault(); // not the settings form's submit
      createKey();
    }
  };
  $("#key-copy").onclick = async () => {
    const value = $("#key-new-value").textContent;
    try {
      await navigator.clipboard.writeText(value);
      $("#key-copy").textContent = "Copied";
    } catch {
      window.getSelection().selectAllChildren($("#key-new-value"));
    }
  };
  await listKeys();
}

async function listKeys() {
  const list = $("#key-list");
  let keys = [];
  try {
    ({ keys } = await getJson("/api/keys"));
  } catch (error) {
    list.replaceChildren(item(`Couldn't list your keys: ${error.detail || error.key}`));
    return;
  }
  list.replaceChildren(...(keys.length ? keys.map(keyItem) : [item("No keys yet.")]));
}

function item(text) {
  const li = document.createElement("li");
  li.className = "hint";
  li.textContent = text;
  return li;
}

function keyItem(key) {
  const li = document.createElement("li");
  li.dataset.keyId = key.id;
  const name = document.createElement("span");
  name.className = "name";
  name.textContent = key.name;
  const prefix = document.createElement("code");
  prefix.textContent = `${key.prefix}…`;
  const revoke = document.createElement("button");
  revoke.type = "button";
  revoke.className = "revoke";
  revoke.textContent = "Revoke";
  revoke.setAttribute("aria-label", `Revoke the key “${key.name}”`);
  revoke.onclick = async () => {
    revoke.disabled = true;
    const response = await api(`/api/keys/${encodeURIComponent(key.id)}`, { method: "DELETE" });
    if (response.ok || response.status === 404) li.remove();
    else revoke.disabled = false;
    if (!$("#key-list").childElementCount) listKeys();
  };
  li.append(name, prefix, revoke);
  return li;
}

async function createKey() {
  const name = $("#key-name").value.trim() || "API key";
  $("#key-create").disabled = true;
  try {
    const response = await api("/api/keys", {
      method: "POST",
      headers: { "Content-Type": "application/json" },
      body: JSON.stringify({ name }),
    });
    if (!response.ok) throw await failureOf(response);
    const made = await response.json();
    $("#key-new-value").textContent = made.key;
    $("#key-copy").textContent = "Copy";
    $("#key-new").hidden = false;
    $("#key-name").value = "";
    await listKeys();
  } catch (error) {
    $("#key-new").hidden = true;
    $("#key-list").prepend(item(`Couldn't make a key: ${error.detail || error.key}`));
  } finally {
    $("#key-create").disabled = false;
  }
}

// ---- the admin's users ---------------------------------------------------------------------------

async function openAdmin() {
  $("#admin-invite-code").hidden = true;
  $("#admin-invite-link").hidden = true;
  $("#admin-invite").onclick = invite;
  await drawUsers();
  $("#admin").showModal();
}

function adminError(text) {
  $("#admin-error").hidden = !text;
  $("#admin-error").textContent = text || "";
}

async function drawUsers() {
  let data;
  try {
    data = await getJson("/api/admin/users");
  } catch (error) {
    adminError(`Couldn't list the users: ${error.detail || error.key}`);
    return;
  }
  adminError("");
  const quota = data.tokensPerDay ? `${data.tokensPerDay.toLocaleString()} tokens a day` : "no quota";
  $("#admin-summary").textContent = `${data.users.length} user${data.users.length === 1 ? "" : "s"}. Default: ${quota}. Sign-up: ${data.signup}.`;
  $("#admin-invite").hidden = data.signup !== "invite";
  $("#admin-users").replaceChildren(...data.users.map(userRow));
}

function userRow(user) {
  const row = document.createElement("tr");
  row.dataset.userId = user.id;
  row.classList.toggle("disabled", user.disabled);
  const who = document.createElement("td");
  const box = document.createElement("span");
  box.className = "who";
  const name = document.createElement("span");
  name.textContent = user.name;
  const sub = document.createElement("small");
  sub.textContent = user.email || (user.signIn === "oidc" ? "identity provider" : "app (JWT)");
  box.append(name, sub);
  who.append(box);

  const role = document.createElement("select");
  role.className = "role";
  role.setAttribute("aria-label", `Role of ${user.name}`);
  role.append(new Option("user", "user"), new Option("admin", "admin"));
  role.value = user.role;
  role.onchange = () => change(user, { role: role.value });

  const enabled = document.createElement("input");
  enabled.type = "checkbox";
  enabled.className = "enabled";
  enabled.checked = !user.disabled;
  enabled.setAttribute("aria-label", `${user.name} may sign in`);
  enabled.onchange = () => change(user, { disabled: !enabled.checked });

  const today = document.createElement("td");
  today.className = "today";
  today.textContent = user.tokensToday.toLocaleString();

  const quota = document.createElement("input");
  quota.type = "number";
  quota.min = "0";
  quota.className = "quota";
  quota.placeholder = "default";
  quota.value = user.tokensPerDay ?? "";
  quota.setAttribute("aria-label", `Daily token quota of ${user.name} (empty: the default, 0: none)`);
  quota.onchange = () => change(user, { tokensPerDay: quota.value === "" ? null : Number(quota.value) });

  const cells = [who, cell(role), cell(enabled), today, cell(quota)];
  row.append(...cells);
  return row;
}

function cell(control) {
  const td = document.createElement("td");
  td.append(control);
  return td;
}

async function change(user, body) {
  try {
    const response = await api(`/api/admin/users/${encodeURIComponent(user.id)}`, {
      method: "PATCH",
      headers: { "Content-Type": "application/json" },
      body: JSON.stringify(body),
    });
    if (!response.ok) throw await failureOf(response);
  } catch (error) {
    adminError(error.detail || error.key);
  }
  await drawUsers(); // what the server holds now, whether or not it took the change
}

async function invite() {
  try {
    const response = await api("/api/admin/invites", {
      method: "POST",
      headers: { "Content-Type": "application/json" },
      body: "{}",
    });
    if (!response.ok) throw await failureOf(response);
    const made = await response.json();
    $("#admin-invite-code").textContent = made.invite;
    $("#admin-invite-code").hidden = false;
    // and a link that opens the sign-up with the code filled in (password or provider)
    const link = `${window.location.origin}/signin?invite=${encodeURIComponent(made.invite)}`;
    $("#admin-invite-link").href = link;
    $("#admin-invite-link").textContent = "invite link";
    $("#admin-invite-link").hidden = false;
  } catch (error) {
    adminError(error.detail || error.key);
  }
}
