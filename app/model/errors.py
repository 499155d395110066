"""What goes wrong talking to the model, mapped to the server's errors at the
boundary (`model_errors`): `ModelError` (CHAT_ERROR) when the model cannot be
reached, `StreamError` (STREAM_ERROR) when it answers non-2xx or badly; of those,
`ContextTooLong` (a request longer than its window), `ToolsUnsupported` (a
request refused for its `tools`) and `NoToolTurn` (one answered with nothing).
What a model's error text says is read here (`refuses_tools`, `context_exceeded`,
`cannot_stream_tools`) and kept out of the log (`redact`).
"""

from __future__ import annotations

import contextlib
import logging
import re
import socket
import ssl
from collections.abc import Iterator
from typing import Any

import openai
import orjson

from ..errors import ModelError, StreamError

log = logging.getLogger("app.llm")  # the model's log lines keep one name


class ToolsUnsupported(StreamError):
    """The model (or the server in front of it) refused a request with `tools`."""


class ContextTooLong(StreamError):
    """The model refused a request as longer than its context window (a 400 that
    says so, or a streamed answer that is an empty 200, as llama.cpp's server sends
    it); `window` is the window in tokens when the model named it."""

    def __init__(self, message: str, window: int | None = None) -> None:
        super().__init__(message)
        self.window = window


class NoToolTurn(StreamError):
    """A request with tools was answered with nothing to read (an empty 200)."""


RETRY_AFTER_CAP = 10.0


def stalled(exc: TimeoutError) -> StreamError:
    log.warning("the model stream stalled: %r", exc)
    return StreamError("the model stream broke off: nothing came in time")


#: how servers say they take no tools: "does not support tools", "tool_choice is not
#: supported", "unknown field `tools`", "tools param requires --jinja", "\"auto\" tool
#: choice requires --enable-auto-tool-choice", "does not support Function Calling"
_TOOL_WORD = (
    r"(?<![\w.])(?:tools|tool[ _]choice|tool[ _]use|tool[ _]calling|tool|function[ _]calling)"
    r"(?!\w)"
)
_REFUSAL_WORD = (
    r"(?:\b(?:not|unsupported|unknown|unrecogni[sz]ed|requires?|disabled|unavailable)\b|n't\b)"
)
_NO_TOOLS = re.compile(
    rf"(?i){_TOOL_WORD}\W+(?:\S+\W+){{0,6}}?{_REFUSAL_WORD}"
    rf"|{_REFUSAL_WORD}\W+(?:\S+\W+){{0,6}}?{_TOOL_WORD}"
)
#: errors that name tools but are about a request's messages, not about tools at all
_NOT_ABOUT_TOOLS = re.compile(r"(?i)tool_call|role ['\"]?tool|tool message")
#: how servers say a request is longer than the model's window
_CONTEXT_EXCEEDED = re.compile(
    r"(?i)context[ _]length|context[ _]window|maximum context|too many tokens|prompt is too long"
    r"|input is too long|exceeds? the (?:model'?s? )?(?:context|maximum)"
)


def refuses_tools(status: int, detail: str) -> bool:
    """Whether a 4xx answer says the model or its server takes no `tools` ("does not
    support tools", "tool_choice is not supported", "unknown field tools"). An error
    about the request's size, or about its tool messages (a `tool_call_id` that does
    not match), is not such an answer, though it names tools or functions."""
    if status not in (400, 404, 422, 501):
        return False
    if context_exceeded(detail) or _NOT_ABOUT_TOOLS.search(detail):
        return False
    return bool(_NO_TOOLS.search(detail))


#: how a refusal names streaming ("stream", "streaming")
_STREAMING = re.compile(r"(?i)(?<![\w.])stream(?:ing|ed)?(?!\w)")


def cannot_stream_tools(exc: StreamError) -> bool:
    """Whether a streamed tool turn's failure says that its server cannot answer it
    streamed: nothing came (`NoToolTurn`), it failed (5xx), or its refusal names
    streaming. A request too long for the window says nothing of the kind."""
    if isinstance(exc, NoToolTurn):
        return True
    cause = exc.__cause__
    if isinstance(exc, ContextTooLong) or not isinstance(cause, openai.APIStatusError):
        return False
    if cause.status_code >= 500:
        return True
    return cause.status_code in (400, 422) and bool(_STREAMING.search(status_detail(cause)))


def context_exceeded(detail: str) -> bool:
    """Whether a model's error text says the request is longer than its window."""
    return bool(_CONTEXT_EXCEEDED.search(detail))


#: the window an error names: "maximum context length is 8192 tokens", "exceed context
#: window of 2048", "context length of 4096", "n_ctx: 2048"
_WINDOW = re.compile(r"(?i)(?:context(?:[ _]length|[ _]window)?|n_ctx)\D{0,24}?(\d{3,8})(?!\d)")


def window_named(detail: str) -> int | None:
    """The context window, in tokens, that a model's error text names, if it names one."""
    found = _WINDOW.search(detail)
    return int(found.group(1)) if found else None


@contextlib.contextmanager
def model_errors(what: str, host: str = "") -> Iterator[None]:
    """Map what the SDK and its HTTP layer raise to our errors, told apart by cause:
    `ModelError` (CHAT_ERROR) when the model cannot be reached — the connection was
    refused, its host name does not resolve, a secure connection fails, it does not
    answer in time — and `StreamError` (STREAM_ERROR) when it answers non-2xx (its
    key refused, say) or badly. The messages say what happened in words a person
    can use; the log line says the same with the model's host (never its key, never
    the model's own error text, which may quote the key)."""
    try:
        yield
    except openai.APIStatusError as exc:
        detail = status_detail(exc)
        too_long = exc.status_code in (400, 413, 422) and context_exceeded(detail)
        log.warning(
            "the %s answered %d",
            what,
            exc.status_code,
            extra={
                "fields": {"modelHost": host, "status": exc.status_code, "detail": redact(detail)}
            },
        )
        if too_long:
            window = window_named(detail)
            named = f" ({window} tokens)" if window else ""
            raise ContextTooLong(
                f"the {what} refused the request as longer than its context window{named}",
                window,
            ) from exc
        raise StreamError(_status_message(what, exc.status_code)) from exc
    except (TimeoutError, openai.APITimeoutError, openai.APIConnectionError) as exc:
        cause = connection_cause(exc)
        log.warning(
            "cannot reach the %s: %s",
            what,
            CAUSES[cause][0],
            extra={"fields": {"modelHost": host, "cause": cause}},
        )
        raise ModelError(CAUSES[cause][1].format(what=what)) from exc
    except Exception as exc:
        broke = (openai.OpenAIError, orjson.JSONDecodeError, OSError)
        if not (isinstance(exc, broke) or _is_transport_error(exc)):
            raise
        log.warning(
            "the %s stream broke: %s",
            what,
            type(exc).__name__,
            extra={"fields": {"modelHost": host}},
        )
        raise StreamError(f"the {what} stream broke off") from exc


#: why a model could not be reached: (for the log, for the user)
CAUSES = {
    "refused": (
        "connection refused (nothing listens at llm.base_url?)",
        "the {what} refused the connection: it is not running at the configured address",
    ),
    "dns": (
        "its host name does not resolve (check llm.base_url)",
        "the {what}'s address could not be found: its host name does not resolve",
    ),
    "tls": (
        "the secure connection failed (TLS: certificate, or https to a plain http port)",
        "a secure connection to the {what} could not be made",
    ),
    "timeout": (
        "it did not answer in time",
        "the {what} did not answer in time",
    ),
    "unreachable": (
        "the connection failed",
        "the {what} cannot be reached",
    ),
}


def connection_cause(exc: BaseException) -> str:
    """Why a connection to the model failed, from the chain of causes under what the
    SDK raised (its aiohttp client reports a refused connection as a timeout)."""
    seen = 0
    current: BaseException | None = exc
    while current is not None and seen < 10:
        if isinstance(current, ConnectionRefusedError):
            return "refused"
        if isinstance(current, socket.gaierror):
            return "dns"
        if isinstance(current, ssl.SSLError) or type(current).__name__ in (
            "ClientConnectorCertificateError",
            "ClientSSLError",
            "ClientConnectorSSLError",
        ):
            return "tls"
        current = current.__cause__ or current.__context__
        seen += 1
    current, seen = exc, 0
    while current is not None and seen < 10:
        if isinstance(current, OSError) and not isinstance(current, TimeoutError):
            return "unreachable"
        current = current.__cause__ or current.__context__
        seen += 1
    return "timeout"


def status_detail(exc: openai.APIStatusError) -> str:
    """The model's own words for a non-2xx answer (for the log, redacted)."""
    body: Any = exc.body
    detail = None
    if isinstance(body, dict):
        error = body.get("error", body)
        detail = error.get("message") if isinstance(error, dict) else error
    return str(detail or exc.message)


def _status_message(what: str, status: int) -> str:
    """What a user is told of a non-2xx answer: what it means, never the model's own
    text (which may quote the key it refused)."""
    if status in (401, 403):
        return f"the {what} refused the server's API key ({status})"
    if status == 404:
        return f"the {what} does not know the model asked for, or its address is wrong (404)"
    if status == 429:
        return f"the {what} is rate limiting this server; try again shortly (429)"
    if status == 400:
        return f"the {what} refused the request (400)"
    if status >= 500:
        return f"the {what} failed ({status}); try again shortly"
    return f"the {what} answered {status}"


#: what looks like a key or a token in a model's error text
_SECRET = re.compile(
    r"sk-[^\s,;'\"]*|(key-|Bearer\s+)?[A-Za-z0-9_\-]{20,}|[A-Za-z0-9]{0,8}\*{3,}[A-Za-z0-9]{0,8}"
)


#: what a provider's error quotes (a moderation refusal may quote the prompt)
_QUOTED = re.compile(r"\"[^\"]*\"|“[^”]*”|‘[^’]*’|`[^`]*`|(?<![A-Za-z])'[^']*'")


def redact(text: str) -> str:
    """A model's error text for the log: without what could be a key ("sk-…abcd"
    included) and without what it quotes (a refusal may quote the user's prompt),
    cut to 200 characters."""
    return _SECRET.sub("[redacted]", _QUOTED.sub("“…”", text))[:200]


def retry_after(exc: openai.APIStatusError) -> float:
    value = exc.response.headers.get("retry-after", "")
    try:
        seconds = float(value)
    except ValueError:
        seconds = 1.0
    return min(max(seconds, 0.0), RETRY_AFTER_CAP)


def _is_transport_error(exc: BaseException) -> bool:
    # the SDK's HTTP layer raises its own transport errors (RemoteProtocolError,
    # ReadError, ...) while a streamed body is read; they all end in "Error" and
    # live in the transport package, which we do not import by name
    module = type(exc).__module__ or ""
    return module.startswith(("httpx", "httpcore", "h11", "anyio", "aiohttp"))
