"""A shared or exported chat as a page, as Markdown and as JSON (PROTOCOL §15): pure
functions of a `Snapshot`, no I/O.

The page is made on the server and needs no script: answers are Markdown rendered
with raw HTML off (markdown-it) and then sanitised (nh3, a binding of the ammonia
sanitiser) to a short list of tags, whose links may only be http(s) or mailto.
Questions, titles and sources are escaped text; a source becomes a link only when
its URL is http(s) (`safe_url`). It is sent with a CSP that allows no script at all.
"""

from __future__ import annotations

import html
from datetime import UTC, datetime
from typing import Any

import nh3
from markdown_it import MarkdownIt

from ..chat.records import StoredMessage, iso
from ..chat.shares import Snapshot
from .api import chat_json, message_json, safe_url

#: the share page's headers: no script of any kind, nothing framed, nothing fetched but
#: the page (styles are inline), nothing sent on as a referrer
PAGE_HEADERS = {
    "Content-Security-Policy": (
        "default-src 'none'; style-src 'unsafe-inline'; img-src data:; base-uri 'none';"
        " form-action 'none'; frame-ancestors 'none'"
    ),
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "X-Frame-Options": "DENY",
}
#: the tags an answer may keep once rendered (no images: a shared page fetches nothing)
ANSWER_TAGS = {
    "a", "p", "br", "hr", "em", "strong", "del", "s", "code", "pre", "blockquote",
    "ul", "ol", "li", "h1", "h2", "h3", "h4", "h5", "h6",
    "table", "thead", "tbody", "tr", "th", "td",
}  # fmt: skip
ANSWER_ATTRIBUTES = {"a": {"href", "title"}, "ol": {"start"}, "th": {"align"}, "td": {"align"}}
DESCRIPTION_CHARS = 200

_markdown = MarkdownIt("commonmark", {"html": False, "linkify": False}).enable(
    ["table", "strikethrough"]
)

STYLE = """
body{font:16px/1.6 system-ui,sans-serif;max-width:46rem;margin:2rem auto;padding:0 1rem;
color:#1f2328;background:#fff}
@media (prefers-color-scheme:dark){body{color:#e6edf3;background:#0d1117}a{color:#58a6ff}}
header p,.when{color:#6e7781;font-size:.9rem}
article{border-top:1px solid #d0d7de;padding:1rem 0}
h2{font-size:1.25rem;margin:.5rem 0}
.answer h1,.answer h2,.answer h3{font-size:1.05rem}
pre{overflow-x:auto;padding:.75rem;background:rgba(127,127,127,.12)}
code{font-size:.9em}
table{border-collapse:collapse}th,td{border:1px solid #d0d7de;padding:.25rem .5rem}
.sources{font-size:.9rem}
"""


def render_markdown(text: str) -> str:
    """Markdown as sanitised HTML (raw HTML in the text is shown as text)."""
    rendered = _markdown.render(text)
    return nh3.clean(
        rendered,
        tags=ANSWER_TAGS,
        attributes=ANSWER_ATTRIBUTES,
        url_schemes={"http", "https", "mailto"},
        link_rel="noopener noreferrer nofollow",
    )


def turns(snapshot: Snapshot) -> list[tuple[StoredMessage, StoredMessage | None]]:
    """Each question with its answer (None while it has none), in order."""
    answers = {m.reply_to: m for m in snapshot.messages if m.role == "assistant"}
    return [(m, answers.get(m.id)) for m in snapshot.messages if m.role == "user"]


def sources_of(question: StoredMessage) -> list[tuple[str, str]]:
    """A question's sources as (title, url), the "All Sources" link left out."""
    out = []
    for source in question.sources:
        meta = source.get("metadata") if isinstance(source, dict) else None
        if not isinstance(meta, dict):
            continue
        url, title = str(meta.get("url") or ""), str(meta.get("title") or "")
        if url.startswith("//"):  # the server's own "All Sources" link
            continue
        out.append((title or url or "(untitled)", url))
    return out


def snapshot_json(snapshot: Snapshot, *, owner: bool = False) -> dict[str, Any]:
    """A snapshot as `GET /api/chats/{id}` shows a chat; its owner's id only for the
    `owner` (an export), never on a share."""
    chat = chat_json(snapshot.chat, snapshot.files)
    if not owner:
        del chat["userId"]
    questions = {m.id: m for m in snapshot.messages if m.role == "user"}
    return {
        "chat": chat,
        "messages": [message_json(m, questions.get(m.reply_to or "")) for m in snapshot.messages],
    }


def _day(ts: float) -> str:
    return datetime.fromtimestamp(ts, UTC).strftime("%Y-%m-%d")


def description(snapshot: Snapshot) -> str:
    """The first answer's first words, as plain text (Open Graph's description)."""
    for _question, answer in turns(snapshot):
        if answer is not None and answer.content.strip():
            text = nh3.clean(render_markdown(answer.content), tags=set())
            words = " ".join(html.unescape(text).split())
            if len(words) > DESCRIPTION_CHARS:
                words = words[: DESCRIPTION_CHARS - 1].rsplit(" ", 1)[0] + "…"
            return words
    return ""


def share_page(snapshot: Snapshot, *, url: str = "", indexable: bool = False) -> str:
    """The chat as one HTML page, readable without scripts."""
    e = html.escape
    title = snapshot.chat.title or "Shared chat"
    head = [
        "<!doctype html>",
        '<html lang="en"><head><meta charset="utf-8">',
        '<meta name="viewport" content="width=device-width, initial-scale=1">',
        f"<title>{e(title)}</title>",
        f'<meta name="description" content="{e(description(snapshot))}">',
        f'<meta property="og:title" content="{e(title)}">',
        f'<meta property="og:description" content="{e(description(snapshot))}">',
        '<meta property="og:type" content="article">',
    ]
    if url:
        head.append(f'<meta property="og:url" content="{e(url)}">')
    if not indexable:
        head.append('<meta name="robots" content="noindex">')
    head.append(f"<style>{STYLE}</style></head><body>")
    byline = f"Shared by {e(snapshot.display_name)} · " if snapshot.display_name else ""
    when = iso(snapshot.shared_at)
    body = [
        f"<header><h1>{e(title)}</h1>",
        f'<p>{byline}<time datetime="{when}">{_day(snapshot.shared_at)}</time></p></header>',
        "<main>",
    ]
    for question, answer in turns(snapshot):
        body.append("<article>")
        body.append(f"<h2>{e(question.content)}</h2>")
        body.append(
            f'<p class="when"><time datetime="{iso(question.created_at)}">'
            f"{_day(question.created_at)}</time></p>"
        )
        if answer is not None:
            body.append(f'<div class="answer">{render_markdown(answer.content)}</div>')
        sources = sources_of(question)
        if sources:
            body.append('<section class="sources"><h3>Sources</h3><ol>')
            for name, link in sources:
                if safe_url(link):
                    body.append(
                        f'<li><a href="{e(link, quote=True)}" rel="noopener noreferrer nofollow">'
                        f"{e(name)}</a></li>"
                    )
                else:
                    body.append(f"<li>{e(name)}</li>")
            body.append("</ol></section>")
        body.append("</article>")
    body.append("</main></body></html>")
    return "\n".join(head + body)


#: what a URL may not hold bare inside Markdown's `(…)`
_MD_URL = str.maketrans({c: f"%{ord(c):02X}" for c in " ()<>\n\t"})


def _md_link_text(text: str) -> str:
    return " ".join(text.split()).replace("\\", "\\\\").replace("[", "\\[").replace("]", "\\]")


def share_markdown(snapshot: Snapshot) -> str:
    """The chat as Markdown: its title, each question as a heading, the answer, and its
    sources as a numbered list of links (only http(s) URLs become links)."""
    parts = [f"# {' '.join(snapshot.chat.title.split()) or 'Shared chat'}", ""]
    for question, answer in turns(snapshot):
        parts += [f"## {' '.join(question.content.split())}", ""]
        if answer is not None and answer.content.strip():
            parts += [answer.content.strip(), ""]
        sources = sources_of(question)
        if sources:
            parts += ["Sources:", ""]
            for n, (name, link) in enumerate(sources, start=1):
                label = _md_link_text(name)
                if safe_url(link):
                    parts.append(f"{n}. [{label}]({link.translate(_MD_URL)})")
                else:
                    parts.append(f"{n}. {label}")
            parts.append("")
    return "\n".join(parts).rstrip() + "\n"
