// One question and its answer on the page: steps, sources, reasoning, the answer as
// sanitised Markdown with [N] citations, its status, actions, media and follow-ups.

import { auth, explain, sentence } from "./net.js";

/** What the page knows of the server (from /api/config). */
export const site = { searchProvider: "" };

const ICONS = {
  copy: '<rect x="9" y="9" width="11" height="11" rx="2"/><path d="M5 15V5a2 2 0 0 1 2-2h8"/>',
  regenerate: '<path d="M20 11a8 8 0 1 0-2.3 5.7"/><path d="M20 4v7h-7"/>',
  edit: '<path d="M4 20h4L19 9l-4-4L4 16z"/>',
  image: '<rect x="3" y="4" width="18" height="16" rx="2"/><circle cx="9" cy="10" r="2"/><path d="m21 16-5-5-9 9"/>',
  video: '<rect x="3" y="5" width="13" height="14" rx="2"/><path d="m16 10 5-3v10l-5-3z"/>',
  trash: '<path d="M4 7h16M9 7V4h6v3M6 7l1 13h10l1-13"/>',
  file: '<path d="M14 3H6v18h12V7z"/><path d="M14 3v4h4"/>',
};

/** A button with an icon and a label (the label hides on narrow screens). */
export function button(className, label, iconName, title = label) {
  const el = document.createElement("button");
  el.type = "button";
  el.className = className;
  el.title = title;
  if (iconName) {
    el.innerHTML = `<svg viewBox="0 0 24 24" aria-hidden="true">${ICONS[iconName]}</svg>`;
  }
  const text = document.createElement("span");
  text.className = "label";
  text.textContent = label;
  el.append(text);
  return el;
}

export function fileChip(name, iconName = "file") {
  const chip = document.createElement("span");
  chip.className = "chip";
  chip.innerHTML = `<svg viewBox="0 0 24 24" aria-hidden="true">${ICONS[iconName]}</svg>`;
  const label = document.createElement("span");
  label.className = "name";
  label.textContent = name;
  chip.append(label);
  return chip;
}

export class TurnView {
  /** `hooks`: {copy, regenerate, edit, retry, media, pick, enterKey} called with this view. */
  constructor(question, hooks, files = []) {
    this.el = document.querySelector("#turn-template").content.firstElementChild.cloneNode(true);
    this.el.turnView = this;
    this.hooks = hooks;
    this.question = question;
    this.reset();
    this.part("question").textContent = question;
    const chips = this.part("files");
    for (const name of files) chips.append(fileChip(name));
    chips.hidden = !files.length;
    document.querySelector("#turns").append(this.el);
  }

  part(name) {
    return this.el.querySelector(`.${name}`);
  }

  /** Back to an empty answer (a replay from the first event, a regenerate). */
  reset() {
    this.answer = "";
    this.reasoning = "";
    this.sources = [];
    this.steps = [];
    this.pending = false;
    this.el.dataset.state = "streaming";
    for (const name of ["answer", "sources", "reasoning-text", "step-list", "status", "media"]) {
      this.part(name).replaceChildren();
    }
    this.part("reasoning").hidden = true;
    this.part("steps").hidden = true;
    this.part("steps").open = false;
    this.part("notice").hidden = true;
    this.part("actions").hidden = true;
    this.part("related").hidden = true;
  }

  onEvent(event) {
    switch (event.type) {
      case "rewrited":
        this.step(`Searching for: ${event.content}`);
        break;
      case "progress":
        this.step(event.data);
        break;
      case "sources":
        this.showSources(event.data);
        break;
      case "reasoning":
        this.reasoning += event.data;
        this.part("reasoning").hidden = false;
        this.part("reasoning-text").textContent = this.reasoning;
        this.changed();
        break;
      case "message":
        this.answer += event.data;
        this.render();
        break;
      case "messageEnd":
        this.end(event.status || "completed");
        break;
      case "error":
        this.fail(event.key, event.data, event.retryAfter);
        break;
    }
  }

  // ---- steps ----------------------------------------------------------------------

  /** A progress step: the latest shows while it works, all of them stay afterwards. */
  step(text) {
    this.steps.push(text);
    const line = document.createElement("li");
    line.textContent = text;
    this.part("step-list").append(line);
    const box = this.part("steps");
    box.hidden = false;
    box.querySelector("summary").textContent = text;
    const failed = /^(?:.*: )?web search failed \((.*)\)$/.exec(text);
    if (failed) this.searchProblem(failed[1]);
    else if (text === "answering without sources" && !this.part("notice").textContent) {
      this.notice("Answered without web sources.");
    }
    this.changed();
  }

  searchProblem(reason) {
    const unconfigured = /not configured|configure|needs|not installed|no .*key|not both set|is set/i.test(reason);
    if (unconfigured) {
      this.notice(
        `Web search is not set up on this server, so this answer has no web sources (${reason}). ` +
          `${searchFix(reason)}`,
        "search-off",
      );
    } else {
      this.notice(
        `Web search failed: ${sentence(reason)} This answer has no web sources. ` +
          "To get them, set a search key (TAVILY_API_KEY), point the server at a SearxNG " +
          "instance (SEARXNG_URL), or untick “Search the web” to ask the model alone.",
      );
    }
  }

  notice(text, kind = "") {
    const box = this.part("notice");
    box.textContent = text;
    box.className = `notice ${kind}`;
    box.hidden = false;
  }

  // ---- sources and answer -------------------------------------------------------------

  showSources(entries) {
    const box = this.part("sources");
    box.replaceChildren();
    box.classList.remove("collapsed");
    this.sources = (entries || []).filter((s) => s.metadata && s.metadata.title !== "All Sources");
    this.sources.forEach((source, i) => {
      const meta = source.metadata;
      const url = safeUrl(meta.url);
      const card = document.createElement(url === "#" ? "div" : "a");
      card.className = "source";
      if (url !== "#") {
        card.href = url;
        card.target = "_blank";
        card.rel = "noopener noreferrer";
      }
      card.title = meta.title || meta.url || "";
      const title = document.createElement("span");
      title.className = "t";
      const n = document.createElement("span");
      n.className = "n";
      n.textContent = String(i + 1);
      title.append(n, meta.title || meta.url || "untitled");
      const host = document.createElement("div");
      host.className = "h";
      host.textContent = url === "#" ? `your file${meta.page ? `, page ${meta.page}` : ""}` : hostOf(url);
      card.append(title, host);
      box.append(card);
    });
    const all = (entries || []).find((s) => s.metadata && s.metadata.title === "All Sources");
    if (all && safeUrl(all.metadata.url) !== "#") {
      const link = document.createElement("a");
      link.className = "source all";
      link.href = safeUrl(all.metadata.url);
      link.target = "_blank";
      link.rel = "noopener noreferrer";
      link.textContent = "All sources";
      box.append(link);
    }
    if (this.sources.length > 4) {
      // four cards and "+N more"; phones scroll through them all sideways instead
      box.classList.add("collapsed");
      const more = document.createElement("button");
      more.type = "button";
      more.className = "more";
      const hosts = [...new Set(this.sources.slice(4).map((s) => hostOf(safeUrl(s.metadata.url))))];
      more.innerHTML = `<span class="t"></span><span class="h"></span>`;
      more.querySelector(".t").textContent = `+${this.sources.length - 4} more`;
      more.querySelector(".h").textContent = hosts.filter(Boolean).slice(0, 3).join(", ");
      more.addEventListener("click", () => {
        box.classList.remove("collapsed");
        more.remove();
        box.querySelector(".source:nth-child(5)")?.focus();
        this.changed();
      });
      box.append(more);
    }
    if (this.answer) this.part("answer").innerHTML = markdown(streamed(this.answer), this.sources);
    this.changed();
  }

  render() {
    if (this.pending) return;
    this.pending = true;
    requestAnimationFrame(() => {
      this.pending = false;
      this.part("answer").innerHTML = markdown(streamed(this.answer), this.sources);
      this.changed();
    });
  }

  changed() {
    this.el.dispatchEvent(new CustomEvent("grew", { bubbles: true }));
  }

  /** The answer is over: `completed`, `cancelled` or `failed`; `note` replaces the
   * status line's words (null: the caller writes it). */
  end(status, note = "") {
    this.el.dataset.state = status;
    this.part("answer").innerHTML = markdown(this.answer, this.sources);
    const steps = this.part("steps");
    steps.querySelector("summary").textContent =
      `${this.steps.length} step${this.steps.length === 1 ? "" : "s"}: ${this.steps[this.steps.length - 1] || ""}`;
    if (note !== null) {
      const line = this.part("status");
      line.className = `status ${status}`;
      line.textContent = note || (status === "cancelled" ? "Stopped" : status === "failed" ? "This answer failed." : "");
      if (status === "failed") this.retryButton();
    }
    this.showActions();
    this.changed();
  }

  /** A failure: words a person understands, a Retry button, the server's words folded away. */
  fail(key, detail = "", retryAfter = 0) {
    this.el.dataset.error = key;
    this.end("failed", null);
    const { text, action } = explain(key, detail, retryAfter);
    const line = this.part("status");
    line.className = "status failed";
    line.textContent = text;
    if (action === "key") {
      const enter = button("enter-key", auth.accounts ? "Sign in" : "Enter API key", null);
      enter.addEventListener("click", () => this.hooks.enterKey(this));
      line.append(" ", enter);
    }
    this.retryButton();
    if (detail && detail !== text) {
      const more = document.createElement("details");
      more.className = "detail";
      const summary = document.createElement("summary");
      summary.textContent = "Details";
      const body = document.createElement("code");
      body.textContent = `${key}: ${detail}`;
      more.append(summary, body);
      line.append(more);
    }
  }

  retryButton() {
    const retry = button("retry", "Retry", "regenerate");
    retry.addEventListener("click", () => this.hooks.retry(this));
    this.part("status").append(" ", retry);
  }

  /** A note under a streaming answer (reconnecting…); null removes it. */
  connection(text) {
    const line = this.part("status");
    line.className = text ? "status reconnecting" : "status";
    line.textContent = text || "";
    if (text) this.changed();
  }

  showActions() {
    const bar = this.part("actions");
    bar.replaceChildren();
    const copy = button("copy", "Copy", "copy", "Copy the answer");
    copy.addEventListener("click", () => this.hooks.copy(this, copy));
    const again = button("regenerate", "Regenerate", "regenerate", "Answer this question again");
    again.addEventListener("click", () => this.hooks.regenerate(this));
    const edit = button("edit", "Edit", "edit", "Edit the question and ask again");
    edit.addEventListener("click", () => this.startEdit());
    const images = button("images", "Images", "image", "Search images for this question");
    images.addEventListener("click", () => this.hooks.media(this, "images"));
    const videos = button("videos", "Videos", "video", "Search videos for this question");
    videos.addEventListener("click", () => this.hooks.media(this, "videos"));
    if (this.el.dataset.state === "failed") {
      // Retry (in the status line) asks again; images and videos wait for an answer
      if (this.answer) bar.append(copy);
      bar.append(edit);
    } else {
      if (!this.answer) copy.disabled = true;
      bar.append(copy, again, edit, images, videos);
    }
    bar.hidden = false;
  }

  // ---- edit and resend ------------------------------------------------------------------

  startEdit() {
    if (this.el.querySelector(".editor")) return;
    const editor = document.createElement("form");
    editor.className = "editor";
    const box = document.createElement("textarea");
    box.value = this.question;
    box.setAttribute("aria-label", "Edit your question");
    box.rows = Math.min(6, Math.max(2, this.question.split("\n").length));
    const send = button("primary", "Send", null);
    send.type = "submit";
    const cancel = button("cancel", "Cancel", null);
    editor.append(box, send, cancel);
    const question = this.part("question");
    question.hidden = true;
    question.after(editor);
    const close = () => {
      editor.remove();
      question.hidden = false;
    };
    cancel.addEventListener("click", close);
    editor.addEventListener("submit", (event) => {
      event.preventDefault();
      const text = box.value.trim();
      if (!text) return;
      close();
      this.hooks.edit(this, text);
    });
    box.addEventListener("keydown", (event) => {
      if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
        event.preventDefault();
        editor.requestSubmit();
      } else if (event.key === "Escape") {
        event.stopPropagation();
        close();
      }
    });
    box.focus();
    box.setSelectionRange(box.value.length, box.value.length);
  }

  // ---- images, videos, follow-ups ------------------------------------------------------------

  /** Images or videos found for this answer (`null`: searching). */
  showMedia(kind, items, failure = "") {
    const box = this.part("media");
    let group = box.querySelector(`.${kind}`);
    if (!group) {
      group = document.createElement("div");
      group.className = `group ${kind}`;
      box.append(group);
    }
    group.replaceChildren();
    if (items === null) {
      group.textContent = `Searching ${kind}…`;
      return;
    }
    if (failure || !items.length) {
      group.textContent = failure || `No ${kind} found for this question.`;
      group.classList.add("none");
      return;
    }
    group.classList.remove("none");
    for (const item of items.slice(0, 8)) {
      const card = document.createElement("a");
      card.className = "thumb";
      card.href = safeUrl(item.url) === "#" ? safeUrl(item.img_src) : safeUrl(item.url);
      card.target = "_blank";
      card.rel = "noopener noreferrer";
      card.title = item.title || "";
      const img = document.createElement("img");
      img.src = safeUrl(item.img_src);
      img.alt = item.title || "";
      img.loading = "lazy";
      img.referrerPolicy = "no-referrer";
      card.append(img);
      if (kind === "videos") {
        card.classList.add("video");
        const player = item.iframe_src && /^https:\/\//i.test(item.iframe_src) ? item.iframe_src : null;
        if (player) {
          card.addEventListener("click", (event) => {
            event.preventDefault();
            const frame = document.createElement("iframe");
            frame.src = player;
            frame.title = item.title || "video";
            frame.allow = "autoplay; encrypted-media; picture-in-picture";
            frame.allowFullscreen = true;
            frame.referrerPolicy = "no-referrer";
            card.replaceWith(frame);
          });
        }
      }
      group.append(card);
    }
    this.changed();
  }

  showRelated(questions) {
    const box = this.part("related");
    const list = box.querySelector("ul");
    list.replaceChildren();
    for (const text of questions) {
      const item = document.createElement("li");
      const pick = document.createElement("button");
      pick.type = "button";
      pick.textContent = text;
      pick.addEventListener("click", () => this.hooks.pick(text));
      item.append(pick);
      list.append(item);
    }
    box.hidden = !questions.length;
    this.changed();
  }
}

/** How to make web search work, from what the server said was missing and the
 * configured provider (`searchProvider` of /api/config). */
export function searchFix(said) {
  const reason = `${said} ${site.searchProvider}`;
  if (/tavily/i.test(reason)) return "To fix it, set TAVILY_API_KEY (or tavily.api_key in config.toml) and restart the server.";
  if (/searxng/i.test(reason)) return "To fix it, set SEARXNG_URL to a SearxNG instance with JSON output on, and restart the server.";
  if (/google/i.test(reason)) return "To fix it, set GOOGLE_API_KEY and GOOGLE_CSE_ID, and restart the server.";
  if (/not installed/i.test(reason)) return "To fix it, install the keyless search (.venv/bin/pip install ddgs) or set TAVILY_API_KEY, and restart the server.";
  if (/ddgs|keyless|duckduckgo|offline/i.test(reason)) return "To get sources, set a search key (TAVILY_API_KEY), point the server at a SearxNG instance (SEARXNG_URL), or untick “Search the web” to ask the model alone.";
  return "To fix it, configure a search provider ([search] in config.toml) and restart the server.";
}

/** An answer still streaming, as it can be shown: a marker whose closing half has not
 * come yet (`**Demo`, `` `code``, `*word`) is left out until it does, so half-written
 * Markdown never shows raw. Emphasis never crosses a paragraph, so only the last one is
 * looked at; inside an open code block everything shows as code anyway. The final
 * answer is rendered as it is. */
export function streamed(text) {
  if (countOf(text, "```") % 2) return text;
  const start = text.lastIndexOf("\n\n") + 1;
  let tail = text.slice(start);
  for (const marker of ["`", "**", "__"]) {
    if (countOf(tail.replaceAll("```", ""), marker) % 2) tail = withoutLast(tail, marker);
  }
  // a star with a space on both sides (a list's bullet, 2 * 3) is no emphasis
  const stars = tail.replace(/\*\*/g, "").replace(/(^|\s)\*(?=\s|$)/gm, "$1");
  if (countOf(stars, "*") % 2) {
    const opening = [...tail.matchAll(/\*(?=[^\s*])/g)].pop();
    if (opening) tail = tail.slice(0, opening.index) + tail.slice(opening.index + 1);
  }
  return text.slice(0, start) + tail;
}

function countOf(text, marker) {
  return text.split(marker).length - 1;
}

function withoutLast(text, marker) {
  const at = text.lastIndexOf(marker);
  return text.slice(0, at) + text.slice(at + marker.length);
}

export function markdown(text, sources) {
  const cited = text.replace(/\[(\d+)\]/g, (whole, n) => {
    const source = sources[Number(n) - 1];
    if (!source) return whole;
    const url = safeUrl(source.metadata.url);
    if (url === "#") return `<span class="cite">[${n}]</span>`;
    return `<a class="cite" href="${escapeAttr(url)}" target="_blank" rel="noopener noreferrer">[${n}]</a>`;
  });
  const html = window.marked ? window.marked.parse(cited) : escapeHtml(cited);
  return window.DOMPurify ? window.DOMPurify.sanitize(html, { ADD_ATTR: ["target"] }) : escapeHtml(text);
}

export function safeUrl(url) {
  if (typeof url !== "string") return "#";
  if (url.startsWith("//") || /^https?:\/\//i.test(url)) return url;
  return "#";
}

function hostOf(url) {
  try {
    return new URL(url, window.location.href).host.replace(/^www\./, "");
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
