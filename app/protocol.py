"""The wire protocol: request parsing and validation, events, and their renderers.

Every check a request needs before a stream may start is here, so that a
refusal can still be an HTTP status (SSE) or one `error` frame (WebSocket).
Events are plain data; the only code that turns them into JSON is
`render(event, format)` below (one function per format).
"""

from __future__ import annotations

import abc
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import date, datetime
from typing import Any, Generic, TypeVar

import orjson

from .errors import AppError, BadRequest
from .events import FOCUS_MODES, Event, Handle
from .ids import is_number, parse_id
from .results import CONTEXT_SIZES, RECENCY, SearchFilters

OPTIMIZATION_MODES = ("speed", "balanced", "quality")
FORMATS = ("default", "simple")
MAX_FILES = 50
MAX_COLLECTIONS = 20
#: history roles → the model's roles (PROTOCOL §1)
ROLES = {"human": "user", "user": "user", "ai": "assistant", "assistant": "assistant"}
MAX_JSON_DEPTH = 32
MAX_DOMAINS = 20
_DOMAIN = re.compile(
    r"(?:[a-z0-9](?:[a-z0-9-]{0,61}[a-z0-9])?\.)*[a-z0-9](?:[a-z0-9-]{0,61}[a-z0-9])?"
)


@dataclass(frozen=True, slots=True)
class ChatRequest:
    """A validated `type: "message"` request (PROTOCOL §1)."""

    user_id: str
    content: str
    chat_id: str | None = None
    message_id: str | None = None
    focus_mode: str = "webSearch"
    copilot_enabled: bool = True
    optimization_mode: str = "speed"
    history: tuple[tuple[str, str], ...] | None = None
    files: tuple[str, ...] = ()
    collections: tuple[str, ...] = ()  # knowledge collections to search (PROTOCOL §12)
    sources: tuple[str, ...] = ()  # the kinds of sources allowed (empty: the mode decides)
    instructions: str = ""  # extra instructions for the model (Perplexica's systemInstructions)
    model: str | None = None  # a configured chat model the client picked
    provider: str | None = None  # whose model it is (`chatModel.provider`; None: the default)
    #: the caller may not use the providers kept for admins (a non-admin, with accounts)
    restricted: bool = False
    format: str = "default"
    host: str = ""  # the Host the request came to (for links), set by the transport
    transport: str = ""  # "sse" or "ws", for logs and metrics only
    cap_key: str = ""  # whom the concurrency cap counts: the key's user, else the address
    search: SearchFilters | None = None  # what web search is kept to (`search`)
    images: bool = False  # find images for the answer too (Perplexity's `return_images`)
    related: bool = False  # suggest follow-up questions (`return_related_questions`)


@dataclass(frozen=True, slots=True)
class ControlRequest:
    """A WebSocket `cancel`, `resume` or `ping` frame, or the cancel endpoint's body."""

    type: str
    chat_id: str | None = None
    user_id: str | None = None
    last_event_id: str | None = None
    format: str = "default"


def loads(raw: bytes | str) -> Any:
    """Decode JSON or raise `BadRequest` saying why."""
    try:
        value = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise BadRequest(f"body is not valid JSON: {exc}") from exc
    if _depth(value) > MAX_JSON_DEPTH:
        raise BadRequest(f"JSON is nested deeper than {MAX_JSON_DEPTH} levels")
    return value


def _depth(value: Any) -> int:
    depth, level = 0, [value]
    while level:
        depth += 1
        if depth > MAX_JSON_DEPTH:
            return depth
        nxt: list[Any] = []
        for item in level:
            if isinstance(item, dict):
                nxt.extend(item.values())
            elif isinstance(item, list):
                nxt.extend(item)
        level = nxt
    return depth - 1


def parse_chat_request(
    body: Any,
    *,
    max_content_chars: int,
    max_history_messages: int = 200,
    format_override: str | None = None,
    host: str = "",
    transport: str = "",
) -> ChatRequest:
    """Validate a decoded chat request. Raises `BadRequest` naming the field."""
    if not isinstance(body, dict):
        raise BadRequest("request must be a JSON object")
    kind = body.get("type", "message")
    if kind != "message":
        raise BadRequest(f"type must be 'message', got {kind!r}")
    message = body.get("message")
    if not isinstance(message, dict):
        raise BadRequest("message must be an object with content")
    content = message.get("content")
    if not isinstance(content, str) or not content.strip():
        raise BadRequest("message.content must be a non-empty string")
    if len(content) > max_content_chars:
        raise BadRequest(f"message.content is longer than {max_content_chars} characters")
    chat_id = message.get("chatId")
    message_id = message.get("messageId")
    user_id = body.get("userId")

    focus_mode = body.get("focusMode", "webSearch")
    if focus_mode not in FOCUS_MODES:
        raise BadRequest(f"focusMode must be one of {', '.join(FOCUS_MODES)}")
    optimization_mode = body.get("optimizationMode", "speed")
    if optimization_mode not in OPTIMIZATION_MODES:
        raise BadRequest(f"optimizationMode must be one of {', '.join(OPTIMIZATION_MODES)}")
    copilot = body.get("copilotEnabled", True)
    if not isinstance(copilot, bool):
        raise BadRequest("copilotEnabled must be true or false")
    fmt = format_override or body.get("format", "default")
    if fmt not in FORMATS:
        raise BadRequest(f"format must be one of {', '.join(FORMATS)}")
    files = body.get("files", [])
    if files is None:
        files = []
    if not isinstance(files, list) or len(files) > MAX_FILES:
        raise BadRequest(f"files must be a list of at most {MAX_FILES} file ids")
    collections = parse_collections(body.get("collections"))
    sources = parse_sources(body.get("sources"))
    instructions = body.get("systemInstructions", "")
    if not isinstance(instructions, str) or len(instructions) > max_content_chars:
        raise BadRequest(
            f"systemInstructions must be a string of at most {max_content_chars} characters"
        )
    history = parse_history(body.get("history"), max_history_messages, max_content_chars)
    search = parse_search(body.get("search"))
    provider, model = parse_chat_model(body.get("chatModel"))
    if history and history[-1] == ("user", content):
        history = history[:-1]  # the question itself, as the Perplexica UI sends it

    return ChatRequest(
        user_id=parse_id(user_id, "userId") if user_id not in (None, "") else "0",
        content=content,
        chat_id=parse_id(chat_id, "message.chatId") if chat_id not in (None, "") else None,
        message_id=parse_id(message_id, "message.messageId")
        if message_id not in (None, "")
        else None,
        focus_mode=focus_mode,
        copilot_enabled=copilot,
        optimization_mode=optimization_mode,
        history=history,
        files=tuple(dict.fromkeys(parse_id(f, "files[]") for f in files)),
        collections=collections,
        sources=sources,
        instructions=instructions.strip(),
        format=fmt,
        host=host,
        transport=transport,
        search=search,
        provider=provider,
        model=model,
    )


#: what a provider id or a model name may be, at most
MAX_MODEL_CHARS = 200


def parse_chat_model(value: Any) -> tuple[str | None, str | None]:
    """`chatModel` (PROTOCOL §1): `{"provider", "model"}`, or Vane's `{"providerId",
    "key"}`; (None, None) when absent. Whether they exist is the service's check."""
    if value is None:
        return None, None
    if not isinstance(value, dict):
        raise BadRequest('chatModel must be an object {"provider", "model"}')
    provider = value.get("provider", value.get("providerId"))
    model = value.get("model", value.get("key"))
    for name, given in (("chatModel.provider", provider), ("chatModel.model", model)):
        if given is not None and (
            not isinstance(given, str) or not given or len(given) > MAX_MODEL_CHARS
        ):
            raise BadRequest(f"{name} must be a string of 1 to {MAX_MODEL_CHARS} characters")
    if provider is None and model is None:
        return None, None
    return provider, model


def parse_search(value: Any, name: str = "search") -> SearchFilters | None:
    """The `search` controls (PROTOCOL §1): `domains` (a leading `-` excludes one),
    `recency`, `after` / `before` (YYYY-MM-DD; Perplexity's M/D/YYYY too) and
    `contextSize`; None when absent or empty. `BadRequest` names the field."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise BadRequest(f"{name} must be an object")
    domains = value.get("domains") or []
    if not isinstance(domains, list) or len(domains) > MAX_DOMAINS:
        raise BadRequest(f"{name}.domains must be a list of at most {MAX_DOMAINS} domains")
    include: list[str] = []
    exclude: list[str] = []
    for item in domains:
        domain = item.strip().lower() if isinstance(item, str) else ""
        into = exclude if domain.startswith("-") else include
        domain = domain.lstrip("-").split("://")[-1].split("/")[0].removeprefix("www.")
        if not _DOMAIN.fullmatch(domain):
            raise BadRequest(f"{name}.domains: {item!r} is not a domain such as 'arxiv.org'")
        into.append(domain)
    recency = value.get("recency") or ""
    if recency and recency not in RECENCY:
        raise BadRequest(f"{name}.recency must be one of {', '.join(RECENCY)}")
    size = value.get("contextSize") or ""
    if size and size not in CONTEXT_SIZES:
        raise BadRequest(f"{name}.contextSize must be one of {', '.join(CONTEXT_SIZES)}")
    after = _day(value.get("after"), f"{name}.after")
    before = _day(value.get("before"), f"{name}.before")
    if after and before and after > before:
        raise BadRequest(f"{name}.after is later than {name}.before")
    filters = SearchFilters(
        tuple(dict.fromkeys(include)), tuple(dict.fromkeys(exclude)), recency, after, before, size
    )
    return filters if filters != SearchFilters() else None


def _day(value: Any, name: str) -> date | None:
    if value in (None, ""):
        return None
    if isinstance(value, str):
        for form in ("%Y-%m-%d", "%m/%d/%Y"):
            try:
                return datetime.strptime(value.strip(), form).date()
            except ValueError:
                pass
    raise BadRequest(f"{name} must be a date, YYYY-MM-DD (or M/D/YYYY)")


#: the kinds of sources a request may name (PROTOCOL §1 `sources`)
SOURCE_KINDS = ("web", "academic", "discussions", "files")


#: `mcp:<name>` in `sources`: the configured MCP server `<name>` (PROTOCOL §14)
MCP_SOURCE = re.compile(r"mcp:[a-z0-9][a-z0-9_-]{0,29}")


def parse_sources(value: Any) -> tuple[str, ...]:
    """`sources`: a list of `web`, `academic`, `discussions`, `files` and `mcp:<name>`
    (whether such a server is configured is not checked: one that is not is offered
    nothing — a request never adds a server)."""
    if value is None:
        return ()
    if not isinstance(value, list) or not all(
        v in SOURCE_KINDS or (isinstance(v, str) and MCP_SOURCE.fullmatch(v)) for v in value
    ):
        raise BadRequest(f"sources must be a list of {', '.join(SOURCE_KINDS)} or mcp:<name>")
    return tuple(dict.fromkeys(value))


def mcp_servers_named(sources: tuple[str, ...]) -> tuple[str, ...]:
    """The MCP servers a request's `sources` names (`mcp:<name>` → `<name>`)."""
    return tuple(s.removeprefix("mcp:") for s in sources if s.startswith("mcp:"))


def parse_collections(value: Any) -> tuple[str, ...]:
    """`collections`: a list of collection ids (whether the user may read them is the
    service's check, also `BAD_REQUEST`)."""
    if value is None:
        return ()
    if not isinstance(value, list) or len(value) > MAX_COLLECTIONS:
        raise BadRequest(f"collections must be a list of at most {MAX_COLLECTIONS} collection ids")
    return tuple(dict.fromkeys(parse_id(c, "collections[]") for c in value))


def parse_history(
    value: Any, max_messages: int, max_chars: int
) -> tuple[tuple[str, str], ...] | None:
    """`[[role, text], ...]` as (`user` | `assistant`, text) pairs; None when absent.
    Roles: `human` or `user`, `ai` or `assistant` (PROTOCOL §1)."""
    if value is None:
        return None
    if not isinstance(value, list):
        raise BadRequest("history must be a list of [role, text] pairs")
    if len(value) > max_messages:
        raise BadRequest(f"history has more than {max_messages} messages")
    pairs = []
    for i, item in enumerate(value):
        if (
            not isinstance(item, list | tuple)
            or len(item) != 2
            or not all(isinstance(part, str) for part in item)
        ):
            raise BadRequest(f"history[{i}] must be a [role, text] pair of strings")
        role = ROLES.get(item[0])
        if role is None:
            raise BadRequest(f"history[{i}] role must be one of {', '.join(ROLES)}")
        if len(item[1]) > max_chars:
            raise BadRequest(f"history[{i}] is longer than {max_chars} characters")
        pairs.append((role, item[1]))
    return tuple(pairs)


def parse_messages(value: Any, max_messages: int, max_chars: int) -> tuple[tuple[str, str], ...]:
    """A conversation given as `[{"role", "content"}, ...]` (the Perplexica UI's
    `chatHistory`, OpenAI's `messages`) as (`user` | `assistant`, text) pairs; other
    roles (system) and other fields are left out."""
    if not isinstance(value, list):
        raise BadRequest("the conversation must be a list of {role, content} objects")
    pairs = []
    for i, item in enumerate(value[-max_messages:]):
        if not isinstance(item, dict) or not isinstance(item.get("content"), str):
            raise BadRequest(f"message {i} must be an object with a string content")
        role = ROLES.get(str(item.get("role")))
        if role is not None and item["content"]:
            pairs.append((role, item["content"][:max_chars]))
    return tuple(pairs)


def parse_control(body: Any) -> ControlRequest:
    """Validate a cancel/resume/ping request (ids optional where the type allows)."""
    if not isinstance(body, dict):
        raise BadRequest("request must be a JSON object")
    kind = body.get("type")
    chat_id = body.get("chatId")
    user_id = body.get("userId")
    last = body.get("lastEventId")
    if last is not None and not isinstance(last, str):
        raise BadRequest("lastEventId must be a string '<messageId>:<seq>'")
    fmt = body.get("format", "default")
    if fmt not in FORMATS:
        raise BadRequest(f"format must be one of {', '.join(FORMATS)}")
    return ControlRequest(
        type=kind if isinstance(kind, str) else "",
        chat_id=parse_id(chat_id, "chatId") if chat_id not in (None, "") else None,
        user_id=parse_id(user_id, "userId") if user_id not in (None, "") else None,
        last_event_id=last,
        format=fmt,
    )


def parse_event_id(value: str | None) -> tuple[str | None, int]:
    """`"<answerMessageId>:<seq>"` → (answer id, seq); None or "" → (None, 0)."""
    if not value:
        return None, 0
    answer_id, sep, seq = value.partition(":")
    if not sep or not is_number(seq, 12):
        raise BadRequest("Last-Event-ID must look like '<messageId>:<seq>'")
    return parse_id(answer_id, "Last-Event-ID messageId"), int(seq)


# -- events ---------------------------------------------------------------------

#: types that carry no `messageId` on the wire
_NO_MESSAGE_ID = frozenset({"rewrited"})
#: default type → simple type (PROTOCOL §4)
_SIMPLE_TYPES = {
    "rewrited": "info",
    "sources": "info",
    "progress": "info",
    "reasoning": "info",
    "message": "answer",
    "messageEnd": "complete",
    "error": "error",
}


def render_default(event: Event) -> dict[str, Any]:
    out: dict[str, Any] = {"type": event.type, **event.data}
    if event.type not in _NO_MESSAGE_ID:
        out["messageId"] = event.message_id
    out["chatId"] = event.chat_id
    return out


def render_simple(event: Event) -> dict[str, Any] | None:
    """The simplified `type/content/timestamp/metadata` message; None when it has no counterpart."""
    kind = _SIMPLE_TYPES.get(event.type)
    if kind is None:
        return None
    meta: dict[str, Any] = {"chatId": event.chat_id, "messageId": event.message_id}
    data = event.data
    if kind == "info":
        meta["kind"] = event.type
        if event.type == "sources":
            meta["sources"] = data.get("data", [])
            content = f"{max(len(meta['sources']) - 1, 0)} sources"
        elif event.type == "rewrited":
            content = data.get("content", "")
        else:
            content = data.get("data", "")
            if "step" in data:
                meta["step"] = data["step"]
    elif kind == "answer":
        content = data.get("data", "")
    elif kind == "complete":
        meta["status"] = data.get("status", "completed")
        if "questionMessageId" in data:
            meta["questionMessageId"] = data["questionMessageId"]
        if "usage" in data:
            meta["usage"] = data["usage"]
        if "timings" in data:
            meta["timings"] = data["timings"]
        content = "query " + meta["status"]
    else:
        meta["key"] = data.get("key", "INTERNAL")
        content = data.get("data", "")
    return {"type": kind, "content": content, "timestamp": event.ts, "metadata": meta}


def render_simple_start(chat_id: str, message_id: str, question: str) -> dict[str, Any]:
    return {
        "type": "start",
        "content": f"processing query: {question}",
        "timestamp": time.time(),
        "metadata": {"chatId": chat_id, "messageId": message_id},
    }


def render_start(handle: Handle, fmt: str) -> dict[str, Any] | None:
    """What opens a subscription in a format (the simple format's `start`), if anything."""
    if fmt != "simple":
        return None
    return render_simple_start(handle.chat_id, handle.answer_id, handle.question)


def render(event: Event, fmt: str) -> dict[str, Any] | None:
    """The wire dict for an event in a format, or None when the format skips it."""
    if fmt == "simple":
        return render_simple(event)
    return render_default(event)


class TokenJson:
    """The default format's JSON of the events a model's answer is made of — a
    `message` or `reasoning` event whose only field is its text — built around the
    text from bytes made once per answer: what `render_default` and orjson make of
    it, without the dict (`event_id` adds `"eventId"`, as the WebSocket has it). Any
    other event is None: render it."""

    __slots__ = ("answer_id", "event_id", "_heads", "_tail", "_id_tail")

    def __init__(self, *, event_id: bool = False) -> None:
        self.answer_id = ""
        self.event_id = event_id
        self._heads: dict[str, bytes] = {}
        self._tail = b""
        self._id_tail = b""

    def of(self, event: Event) -> bytes | None:
        data = event.data
        if len(data) != 1:
            return None
        text = data.get("data")
        if text.__class__ is not str:
            return None
        if event.message_id != self.answer_id:
            self._for(event)
        head = self._heads.get(event.type)
        if head is None:
            return None
        if self.event_id:
            return b'%s%s%s%d"}' % (head, orjson.dumps(text), self._id_tail, event.seq)
        return head + orjson.dumps(text) + self._tail

    def _for(self, event: Event) -> None:
        self.answer_id = event.message_id
        self._heads = {
            kind: b'{"type":"%s","data":' % kind.encode()
            for kind in ("message", "reasoning")
            if kind not in _NO_MESSAGE_ID
        }
        self._tail = b',"messageId":%s,"chatId":%s}' % (
            orjson.dumps(event.message_id),
            orjson.dumps(event.chat_id),
        )
        self._id_tail = self._tail[:-1] + b',"eventId":"%s:' % event.message_id.encode()


Chunk = TypeVar("Chunk")


class Encoder(abc.ABC, Generic[Chunk]):
    """One wire format, without I/O: what a connection writes before a generation's
    events (`preamble`, once per subscription, a resume too) and for each batch of
    them (`encode`). None means nothing to write. `name` labels metrics."""

    name: str

    def preamble(self, handle: Handle) -> Chunk | None:
        return None

    @abc.abstractmethod
    def encode(self, events: Sequence[Event]) -> Chunk | None: ...


class Events(Encoder[Sequence[Event]]):
    """No wire format: the events themselves, for server-side readers of a generation
    (Perplexica's whole-answer `/api/search`, OpenAI's non-streaming completion)."""

    name = "events"

    def encode(self, events: Sequence[Event]) -> Sequence[Event]:
        return events


def error_body(exc: AppError, **extra: Any) -> dict[str, Any]:
    """The JSON body of an HTTP refusal, or of a WebSocket error frame."""
    return {"type": "error", "key": exc.key, "data": exc.message, **extra}
