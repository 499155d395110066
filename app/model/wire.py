"""The model's streamed answer, decoded: `text/event-stream` bytes in, typed deltas
out (`AnswerDecoder`), `<think>…</think>` split out of the text (`ThinkSplitter`), a
tool turn's chunks put together (`tool_delta`). No sockets, no event loop: the
client (`client.py`) feeds it what it reads, in the read's own callback, so every
token costs one `feed` and no more.

Raises `StreamError` for a chunk that cannot be read or an error reported mid-stream.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import orjson

from ..errors import StreamError
from .errors import ContextTooLong, redact

log = logging.getLogger("app.llm")  # the model's log lines keep one name

Message = dict[str, str]
#: a message of a tool round: its calls and their results are more than text
ToolMessage = dict[str, Any]
#: a tool offered to the model, in OpenAI's format (`type`, `function`: name, schema)
Tool = dict[str, Any]


@dataclass(slots=True)
class Delta:
    """A piece of the model's answer: `reasoning`, `content` or `keepalive`; or, near
    the end, `finish` when the model stopped for another reason than having answered
    (`text` the reason: "length", it reached `max_tokens`), and last `usage`: the
    tokens the model counted (`usage` holds its `usage` object). Not frozen, like
    `Event`: one is made per token."""

    kind: str
    text: str = ""
    usage: dict[str, Any] | None = None


KEEPALIVE = Delta("keepalive")
#: what an answer's deltas are handed to, one by one, as they come
Sink = Callable[[Delta], None]


@dataclass(frozen=True, slots=True)
class ToolCall:
    """One function call the model asked for; `arguments` as it sent them (JSON text,
    perhaps broken: the caller parses it tolerantly)."""

    id: str
    name: str
    arguments: str


@dataclass(frozen=True, slots=True)
class ToolTurn:
    """What the model answered to a request with tools: text, and the calls it made."""

    content: str
    calls: tuple[ToolCall, ...]


class AnswerDecoder:
    """The model's streamed answer (`text/event-stream` bytes, as they come) turned
    into deltas handed to `sink`: one `feed` per read. A `: keep-alive` comment is a
    `keepalive` delta; `data: [DONE]` ends it (`feed` says so). An answer cut at its
    `max_tokens` ends with `Delta("finish", "length")` (from `end`)."""

    __slots__ = ("sink", "splitter", "buffer", "received", "done", "finish")

    def __init__(self, sink: Sink, splitter: ThinkSplitter) -> None:
        self.sink = sink
        self.splitter = splitter
        self.buffer = b""
        self.received = False
        self.done = False
        #: why the model stopped, when it said so ("stop", "length")
        self.finish: str | None = None

    def feed(self, data: bytes) -> bool:
        """Take one read's bytes; whether the answer has ended (`[DONE]`). Raises
        `StreamError` for a chunk that cannot be read, and what `sink` raises."""
        if self.done:
            return True
        if b"\n" not in data:
            self.buffer += data
            return False
        if self.buffer:
            data, self.buffer = self.buffer + data, b""
        *lines, rest = data.split(b"\n")
        if rest:
            self.buffer = rest
        sink, splitter = self.sink, self.splitter
        for line in lines:
            if not line or line == b"\r":
                continue
            if line[0] == 58:  # b":" a comment
                if b"keep-alive" in line:
                    sink(KEEPALIVE)
                continue
            if not line.startswith(b"data:"):
                continue
            payload = line[5:].strip()
            self.received = True
            if payload == b"[DONE]":
                self.done = True
                return True
            for delta in _decode_chunk(payload, splitter, self):
                sink(delta)
        return False

    def end(self) -> list[Delta]:
        """What the splitter still holds, once the stream is over, and the `finish`
        delta of an answer cut at its `max_tokens`. `ContextTooLong` for a stream that
        held nothing at all: an empty 200 is how llama.cpp's server answers a streamed
        prompt longer than its window."""
        if not self.received:
            raise nothing_back()
        out = self.splitter.flush()
        if self.finish == "length":
            out.append(Delta("finish", "length"))
        return out


def nothing_back() -> ContextTooLong:
    """An answer that held nothing: how llama.cpp's server answers a streamed prompt
    longer than its window (an empty 200; llama-cpp-python's closes the connection)."""
    return ContextTooLong(
        "the model sent nothing back, as it does for a prompt longer than its context window"
    )


def _decode_chunk(payload: bytes, splitter: ThinkSplitter, decoder: AnswerDecoder) -> list[Delta]:
    try:
        chunk = orjson.loads(payload)
        choices = chunk.get("choices")
        usage = chunk.get("usage")
        if choices and usage is None:  # the common case: one piece of the answer
            choice = choices[0]
            delta = choice.get("delta") or {}
            content = delta.get("content")
            if (
                content
                and not (delta.get("reasoning_content") or delta.get("reasoning"))
                and not choice.get("finish_reason")
            ):
                return splitter.feed(content)
        if "error" in chunk and not choices:
            error = chunk["error"]
            detail = error.get("message") if isinstance(error, dict) else error
            log.warning("the model reported an error mid-stream: %s", redact(str(detail)))
            raise StreamError("the model reported an error mid-stream")
        counted = [Delta("usage", usage=usage)] if isinstance(usage, dict) else []
        if not choices:
            return counted
        if choices[0].get("finish_reason"):
            decoder.finish = str(choices[0]["finish_reason"])
        delta = choices[0].get("delta") or {}
        reasoning = delta.get("reasoning_content") or delta.get("reasoning")
        content = delta.get("content")
    except StreamError:
        raise
    except (orjson.JSONDecodeError, AttributeError, TypeError, IndexError) as exc:
        log.warning("the model sent a malformed chunk (%d bytes)", len(payload))
        raise StreamError("the model sent a malformed chunk") from exc
    out: list[Delta] = []
    if reasoning:
        out.extend(splitter.reasoning_apart())
        out.append(Delta("reasoning", reasoning))
    if content:
        out.extend(splitter.feed(content))
    return out + counted


def tool_delta(payload: bytes, content: list[str], calls: dict[int, list[str]]) -> None:
    """Add one chunk of a tool turn to its text and calls."""
    try:
        chunk = orjson.loads(payload)
        delta = (chunk.get("choices") or [{}])[0].get("delta") or {}
        if delta.get("content"):
            content.append(delta["content"])
        for piece in delta.get("tool_calls") or ():
            parts = calls.setdefault(int(piece.get("index", len(calls))), ["", "", ""])
            function = piece.get("function") or {}
            parts[0] = piece.get("id") or parts[0]
            parts[1] = function.get("name") or parts[1]
            parts[2] += function.get("arguments") or ""
    except (orjson.JSONDecodeError, AttributeError, TypeError, ValueError) as exc:
        raise StreamError("the model sent a malformed chunk") from exc


class ThinkSplitter:
    """Splits `<think>…</think>` out of content chunks, tags cut across chunks included.

    Some templates (DeepSeek-R1's, served by llama.cpp or vLLM; Qwen3's thinking
    models) leave the opening tag out: the content begins with reasoning and has a
    lone `</think>`. With `assume_open` (a model known to do so) the content starts as
    reasoning, and turns out to have been the answer only if no `</think>` comes.

    A model whose format is not known (`hold`: its name, its server's model list and
    its earlier answers in this process say nothing) could be one of those, and the
    protocol has no way to take back text once sent (`message` chunks only add up),
    so its text is held back until the format shows: a lone `</think>` (what was held
    was reasoning), an opening `<think>` (tags come in pairs: what was held was the
    answer), reasoning sent apart (`reasoning_apart`), or the answer's end (no tag: it
    was all answer). The held deltas then go out as they came, in one go. That costs
    the first token of a model's first answer in a process (the caller remembers what
    it showed: later answers are not held, and those running beside it are let go
    at their next chunk once one has shown it plain: `shown`), and nothing per token
    beyond one flag:
    nothing is looked at per token but the `<` it may hold. `release` hands out what
    is held when the answer stops early (cancelled, broken): as answer, as far as was
    known. `lone_close` says a lone `</think>` was met, so that the caller remembers
    the model and splits its next answers from their start; a model's format is
    learned before its first answer where it can be: by its name, and by what the
    server's model list (read once at start) says — an alias listed with a `root`
    such as DeepSeek-R1-Distill-… is split from its first answer, one listed as not
    reasoning is not held."""

    OPEN, CLOSE = "<think>", "</think>"

    def __init__(
        self,
        *,
        assume_open: bool = False,
        hold: bool = False,
        shown: Callable[[], bool] = lambda: False,
    ) -> None:
        self.inside = assume_open
        self.assumed = assume_open
        self.tagged = False  # a tag was seen
        self.lone_close = False
        #: the format is not known yet: text is held back (`_held`) until it is
        self.holding = hold and not assume_open
        #: whether a chunk without `<` needs more than to be passed on (assumed or held)
        self._unsure = assume_open or self.holding
        self._pending = ""
        self._assumed_text: list[str] = []
        self._held: list[Delta] = []
        #: whether another answer of the model has shown it plain since: what is held
        #: goes out at the next chunk (answers that started together are not all held)
        self._shown = shown

    def reasoning_apart(self) -> list[Delta]:
        """The model sends its reasoning apart (`reasoning_content`): its content is no
        reasoning; what was held back of it, to go out before that reasoning."""
        if not self._unsure:
            return []
        if self.assumed and not self.tagged and not self._assumed_text:
            self.inside = self.assumed = False
        return self.release()

    def feed(self, text: str) -> list[Delta]:
        if self.holding and self._shown():
            return self.release() + self.feed(text)
        if not self._pending and "<" not in text:  # the common case: nothing to look at
            if self._unsure:
                if self.holding:
                    self._held.append(Delta("content", text))
                    return []
                self._assumed_text.append(text)
            return [Delta("reasoning" if self.inside else "content", text)]
        text = self._pending + text
        self._pending = ""
        out: list[Delta] = []
        while text:
            if self.assumed and not self.tagged and text.lstrip().startswith(self.OPEN):
                text = text.lstrip()[len(self.OPEN) :]  # it was not left out after all
                self.tagged = True
                continue
            tags = [self.CLOSE] if self.inside else [self.OPEN]
            if not self.inside and not self.tagged:
                tags.append(self.CLOSE)  # a lone closing tag
            found = min(((text.find(t), t) for t in tags if t in text), default=None)
            if found is not None:
                index, tag = found
                if index:
                    out.append(Delta("reasoning" if self.inside else "content", text[:index]))
                if tag == self.CLOSE and not self.inside:
                    self.lone_close = True
                    if self.holding:  # what was held, and came before it, was reasoning
                        out = [Delta("reasoning", d.text) for d in (*self._held, *out)]
                else:
                    self.inside = not self.inside
                    if self.holding:  # paired tags: what was held was the answer
                        out = [*self._held, *out]
                if self.holding:
                    self._held, self.holding = [], False
                self.tagged = True
                text = text[index + len(tag) :]
                continue
            if self.assumed and not self.tagged and not self._assumed_text:
                tags.append(self.OPEN)  # the tag may come after all, cut across chunks
            keep = max(_partial_suffix(text, t) for t in tags)
            if keep:
                self._pending = text[-keep:]
                text = text[:-keep]
            if text:
                if self.assumed and not self.tagged:
                    self._assumed_text.append(text)
                out.append(Delta("reasoning" if self.inside else "content", text))
            break
        self._unsure = self.holding or (self.assumed and not self.tagged)
        if self.holding:
            self._held.extend(out)
            return []
        return out

    def release(self) -> list[Delta]:
        """What is held back, as answer (no `</think>` came before the stream stopped);
        nothing is held from then on."""
        held, self._held = self._held, []
        self.holding = False
        self._unsure = self.assumed and not self.tagged
        return held

    def flush(self) -> list[Delta]:
        pending, self._pending = self._pending, ""
        out = [Delta("reasoning" if self.inside else "content", pending)] if pending else []
        if self.holding:
            return self.release() + out
        if self.assumed and not self.tagged:
            # no `</think>` came: what was taken for reasoning was the answer
            out.append(Delta("content", "".join(self._assumed_text) + pending))
        return out


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of `text` that begins `tag`."""
    start = text.rfind("<", max(0, len(text) - len(tag) + 1))
    if start < 0:
        return 0
    tail = text[start:]
    return len(tail) if tag.startswith(tail) else 0


def split_think(text: str) -> tuple[str, str, bool]:
    """A whole completion's (reasoning, text, whether its `</think>` was lone). Whole,
    it can be split as a stream cannot: a lone `</think>` (its opening tag left out)
    means that everything up to the last one is reasoning."""
    close = text.rfind(ThinkSplitter.CLOSE)
    if close >= 0:
        first = text.find(ThinkSplitter.CLOSE)
        if ThinkSplitter.OPEN not in text[:first]:
            return text[:close], text[close + len(ThinkSplitter.CLOSE) :], True
    splitter = ThinkSplitter()
    parts = splitter.feed(text) + splitter.flush()
    return (
        "".join(d.text for d in parts if d.kind == "reasoning"),
        "".join(d.text for d in parts if d.kind == "content"),
        False,
    )


def strip_think(text: str) -> str:
    """A whole completion without its reasoning (for small-model answers)."""
    return split_think(text)[1]


class Verbatim(ThinkSplitter):
    """Content as it came, `<think>` tags and all: for a short answer read whole and
    split at its end (`split_think`), which can tell a lone `</think>` as a stream
    cannot."""

    def feed(self, text: str) -> list[Delta]:
        return [Delta("content", text)]

    def flush(self) -> list[Delta]:
        return []
