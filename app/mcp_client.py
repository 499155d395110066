"""The MCP servers an admin configured (`[mcp.servers.<name>]`, PROTOCOL §14 client): one
connection each, kept in the background, whose tools the research agent may call.

`McpServers` is opened in the lifespan and closed with it. Each server has a task of its
own that connects (Streamable HTTP by `url`, stdio by `command`), lists the tools, and
lists them again when the server says they changed (`notifications/tools/list_changed`
on the handshake revisions, a `subscriptions/listen` stream on the stateless one) or
every `RELIST_SECONDS`; when the connection fails it is `down` with why, and it connects
again with a growing pause. Nothing waits for it: what the model is offered is what is
listed now, so an outage never delays an answer that does not use the server.

`call` is bounded by the server's `timeout_seconds`; a response of more than
`MAX_RESPONSE_BYTES` is refused on the wire. Every failure is a `ToolCallFailed` whose
message says why in a few words (never the URL or a header: those may hold secrets).
What a result says is reduced by `result_of` to text for the model, bounded and stripped
of anything that would close the prompt's structure, and to the links it carries.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import httpx2
import orjson
from mcp.client.client import Client
from mcp.client.session import IncomingMessage
from mcp.client.stdio import StdioServerParameters
from mcp.client.streamable_http import streamable_http_client
from mcp.shared.exceptions import MCPError
from mcp.types import (
    CallToolResult,
    EmbeddedResource,
    ResourceLink,
    TextContent,
    TextResourceContents,
    ToolListChangedNotification,
)
from mcp.types.version import MODERN_PROTOCOL_VERSIONS

from .cleaning import clean
from .config import McpServerSettings, McpSettings

log = logging.getLogger("app.mcp_client")

Status = Literal["connecting", "ready", "down"]

#: the most one response may be, on the wire: more is a server that floods
MAX_RESPONSE_BYTES = 4 << 20
#: tools are listed again this often, whatever the server says
RELIST_SECONDS = 300.0
#: the pauses between connection attempts grow from the first to the last
RETRY_SECONDS = (0.5, 30.0)
#: how long closing the connections may take, at shutdown
CLOSE_SECONDS = 5.0
#: tools of one server offered at most (models take some 128 in all)
MAX_TOOLS = 40
#: characters of a tool's description offered to the model
DESCRIPTION_CHARS = 1000
#: links of one result that become sources, at most
MAX_LINKS = 10
#: what a function name may hold (OpenAI: `^[a-zA-Z0-9_-]{1,64}$`)
_NOT_IN_NAME = re.compile(r"[^A-Za-z0-9_-]")
#: what would close or fake the structure of our prompts: the `<context>` block the
#: sources sit in, and the role and turn markers of the common chat templates
_STRUCTURE = re.compile(
    r"</?\s*context\s*>|<\|[^|>]{0,40}\|>|</?\s*(?:start_of_turn|end_of_turn|s)\s*>"
    r"|\[/?INST\]|<</?SYS>>",
    re.IGNORECASE,
)


class ToolCallFailed(Exception):
    """A call that gave no usable result; `str(exc)` says why, for the step and the model."""


class Gone(Exception):
    """The connection is no more (a call found it so); `str(exc)` says how."""


@dataclass(frozen=True, slots=True)
class RemoteTool:
    """One tool of a server, as the model is offered it (`<server>__<tool>`)."""

    server: str
    name: str  # the server's own name for it
    description: str
    schema: dict[str, Any]  # its JSON schema, an object

    @property
    def offered_name(self) -> str:
        return f"{self.server}__{_NOT_IN_NAME.sub('_', self.name)}"[:64]

    def function(self) -> dict[str, Any]:
        """Its schema as a function tool (OpenAI's format)."""
        return {
            "type": "function",
            "function": {
                "name": self.offered_name,
                "description": self.description or f"the tool {self.name} of {self.server}",
                "parameters": self.schema,
            },
        }


@dataclass(frozen=True, slots=True)
class Link:
    """A link a result carries: a source."""

    url: str
    title: str
    text: str = ""


@dataclass(frozen=True, slots=True)
class Result:
    """What a call returned, for the model (`text`: bounded, stripped) and the sources."""

    text: str
    links: tuple[Link, ...] = ()
    truncated: bool = False


class McpServer:
    """One configured server: its connection, kept by a task of its own."""

    def __init__(
        self,
        name: str,
        settings: McpServerSettings,
        max_result_chars: int,
        *,
        allow_stdio: bool = False,
    ) -> None:
        self.name = name
        self.settings = settings
        self.max_result_chars = max_result_chars
        self.allow_stdio = allow_stdio
        self.status: Status = "connecting"
        self.error = ""  # why it is down, in a few words
        self.tools: tuple[RemoteTool, ...] = ()
        self._client: Client | None = None
        self._changed = asyncio.Event()  # the server said its tools changed
        self._broken = asyncio.Event()  # a call found the connection gone
        self._up = asyncio.Event()  # set while it is ready
        #: the tools whose answers were refused for their length (the session goes with
        #: them, and the SDK says only that the connection closed)
        self.flooded: set[str] = set()

    def tool(self, offered_name: str) -> RemoteTool | None:
        return next((t for t in self.tools if t.offered_name == offered_name), None)

    async def wait_ready(self, timeout: float) -> bool:
        """Whether the server is ready within `timeout` seconds (for start-up checks and
        tests; nothing on an answer's path waits for it)."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout):
                await self._up.wait()
        return self.status == "ready"

    async def call(self, tool: RemoteTool, args: dict[str, Any]) -> Result:
        """Call `tool` with `args`, within `timeout_seconds`. Raises `ToolCallFailed`
        saying why (down, timed out, an error, too much). Cancelling is safe: the
        request is abandoned, the connection kept."""
        client = self._client
        if client is None or self.status != "ready":
            raise ToolCallFailed(f"{self.name} is {self.status}" + _because(self.error))
        timeout = self.settings.timeout_seconds
        self.flooded.discard(tool.name)
        try:
            async with asyncio.timeout(timeout):
                result = await client.call_tool(tool.name, args, read_timeout_seconds=timeout)
        except TimeoutError:
            raise ToolCallFailed(f"no answer within {timeout:g} s") from None
        except Exception as exc:  # the transport's and the SDK's own, of every kind
            if tool.name in self.flooded:
                self.flooded.discard(tool.name)
                raise ToolCallFailed(
                    f"{self.name} answered too much (over {MAX_RESPONSE_BYTES >> 20} MB)"
                ) from None
            if isinstance(exc, MCPError) and exc.message != "Connection closed":
                raise ToolCallFailed(
                    f"{self.name} answered an error: {_short(exc.message)}"
                ) from None
            self._broken.set()
            raise ToolCallFailed(f"{self.name} could not be reached ({_why(exc)})") from None
        if result.is_error:
            said = result_of(result, self.max_result_chars).text
            raise ToolCallFailed(f"the tool failed: {_short(said) or 'no reason given'}")
        return result_of(result, self.max_result_chars)

    # -- the connection ------------------------------------------------------------------------

    async def run(self) -> None:
        """Connect, list, listen; again after a pause when it fails. Runs until cancelled
        (or at once, for a command that `mcp.allow_stdio` does not allow)."""
        if self.settings.command and not self.allow_stdio:
            self._down("a command (stdio) needs mcp.allow_stdio")
            return
        pause = RETRY_SECONDS[0]
        while True:
            try:
                await self._connected()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # whatever a server or its transport does
                self._down(_why(exc))
            else:
                self._down("the connection closed")
            if self._up.is_set():
                pause = RETRY_SECONDS[0]  # it was up: try again soon
            self._up.clear()
            await asyncio.sleep(pause)
            pause = min(pause * 2, RETRY_SECONDS[1])

    def _down(self, why: str) -> None:
        if self.status != "down":
            log.warning("MCP server %s is down: %s", self.name, why)
        self.status, self.error, self._client = "down", why, None

    async def _connected(self) -> None:
        """One connection, for as long as it lasts."""
        self._broken.clear()
        timeout = self.settings.timeout_seconds
        async with contextlib.AsyncExitStack() as stack:
            async with asyncio.timeout(timeout):
                client = await stack.enter_async_context(
                    Client(
                        await self._transport(stack),
                        read_timeout_seconds=timeout,
                        message_handler=self._message,
                        cache=None,
                    )
                )
                await self._list(client)
            self._client, self.status, self.error = client, "ready", ""
            self._up.set()
            log.info("MCP server %s is ready: %d tools", self.name, len(self.tools))
            async with asyncio.TaskGroup() as group:
                if client.protocol_version in MODERN_PROTOCOL_VERSIONS:
                    group.create_task(self._listen(client))
                while not self._broken.is_set():
                    with contextlib.suppress(TimeoutError):
                        async with asyncio.timeout(RELIST_SECONDS):
                            await _first(self._changed.wait(), self._broken.wait())
                    if self._broken.is_set():
                        break
                    self._changed.clear()
                    async with asyncio.timeout(timeout):
                        await self._list(client)
                raise Gone("a call found the connection gone")

    async def _transport(self, stack: contextlib.AsyncExitStack) -> Any:
        s = self.settings
        if s.command:
            return StdioServerParameters(command=s.command, args=list(s.args))
        http = await stack.enter_async_context(
            httpx2.AsyncClient(
                headers=dict(s.headers),
                timeout=httpx2.Timeout(s.timeout_seconds, read=None),
                transport=_Bounded(httpx2.AsyncHTTPTransport(), self),
            )
        )
        return streamable_http_client(s.url, http_client=http)

    async def _list(self, client: Client) -> None:
        """The server's tools (every page), kept to `tools` when it is set."""
        listed = []
        cursor: str | None = None
        for _ in range(20):
            page = await client.list_tools(cursor=cursor)
            listed.extend(page.tools)
            cursor = page.next_cursor
            if cursor is None:
                break
        wanted = set(self.settings.tools)
        tools: dict[str, RemoteTool] = {}
        for t in listed:
            if wanted and t.name not in wanted:
                continue
            tool = RemoteTool(
                self.name,
                t.name,
                _stripped(t.description or "")[:DESCRIPTION_CHARS],
                _object_schema(t.input_schema),
            )
            tools.setdefault(tool.offered_name, tool)
        if len(tools) > MAX_TOOLS:
            log.warning(
                "MCP server %s lists %d tools: the first %d are offered (name some in `tools`)",
                self.name,
                len(tools),
                MAX_TOOLS,
            )
        self.tools = tuple(tools.values())[:MAX_TOOLS]

    async def _listen(self, client: Client) -> None:
        """The stateless revision's list-changed events, while the connection lasts."""
        try:
            async with client.listen(tools_list_changed=True) as events:
                async for _ in events:
                    self._changed.set()
        except Exception as exc:  # a server without subscriptions: listed every so often
            log.info("MCP server %s sends no list changes: %s", self.name, _why(exc))

    async def _message(self, message: IncomingMessage) -> None:
        if isinstance(message, ToolListChangedNotification):
            self._changed.set()


class McpServers:
    """The configured MCP servers, each connected in the background (see the module)."""

    def __init__(self, settings: McpSettings) -> None:
        self.servers = {
            name: McpServer(
                name, server, settings.max_result_chars, allow_stdio=settings.allow_stdio
            )
            for name, server in settings.servers.items()
        }
        self._tasks: list[asyncio.Task[None]] = []

    async def __aenter__(self) -> McpServers:
        self._tasks = [
            asyncio.create_task(s.run(), name=f"mcp-server-{s.name}") for s in self.servers.values()
        ]
        return self

    async def __aexit__(self, *exc: object) -> None:
        """Every connection closed (a server that will not let go is left after
        `CLOSE_SECONDS`)."""
        for task in self._tasks:
            task.cancel()
        if self._tasks:
            await asyncio.wait(self._tasks, timeout=CLOSE_SECONDS)
        self._tasks = []

    def tool(self, offered_name: str) -> tuple[McpServer, RemoteTool] | None:
        """The server and tool the model's name for it names (`<server>__<tool>`)."""
        server = self.servers.get(offered_name.partition("__")[0])
        tool = server.tool(offered_name) if server else None
        return (server, tool) if server and tool else None

    def listing(self) -> list[dict[str, Any]]:
        """What `GET /api/mcp/servers` shows: names, statuses, tools (no URL, no header)."""
        return [
            {
                "name": s.name,
                "status": s.status,
                **({"error": s.error} if s.error else {}),
                "default": s.settings.default,
                "tools": [{"name": t.name, "description": t.description} for t in s.tools],
            }
            for s in self.servers.values()
        ]


# -- what a result says ------------------------------------------------------------------------


def result_of(result: CallToolResult, max_chars: int) -> Result:
    """The text of `result` for the model — its text blocks, its resources' text, its
    links named, its structured content when nothing else says anything — cut to
    `max_chars` and stripped of prompt structure; and its web links, as sources."""
    parts: list[str] = []
    links: list[Link] = []
    for block in result.content:
        if isinstance(block, TextContent):
            parts.append(block.text)
        elif isinstance(block, ResourceLink):
            title = block.title or block.name
            parts.append(
                f"{title}: {block.uri}" + (f" ({block.description})" if block.description else "")
            )
            links.append(Link(str(block.uri), title, block.description or ""))
        elif isinstance(block, EmbeddedResource):
            res = block.resource
            text = res.text if isinstance(res, TextResourceContents) else ""
            parts.append(f"{res.uri}:\n{text}" if text else f"(a resource: {res.uri})")
            links.append(Link(str(res.uri), str(res.uri), text))
        else:
            parts.append(f"(a {block.type} result, not shown)")
    structured = result.structured_content
    if structured is not None:
        links.extend(_links_in(structured))
        if not any(isinstance(b, TextContent) for b in result.content):
            parts.append(orjson.dumps(structured).decode(errors="replace"))
    text = _stripped("\n".join(parts))
    web = {link.url: link for link in links if _is_web(link.url)}
    cut = len(text) > max_chars
    kept = tuple(
        Link(link.url[:2048], _stripped(link.title)[:200], _stripped(link.text)[:2000])
        for link in list(web.values())[:MAX_LINKS]
    )
    return Result(text[:max_chars] + ("\n(cut here)" if cut else ""), kept, cut)


def _links_in(value: Any, depth: int = 0) -> list[Link]:
    """Objects with a web `url` (or `uri`, `link`) anywhere in structured content."""
    if depth > 6:
        return []
    found: list[Link] = []
    if isinstance(value, Mapping):
        url = next(
            (value[k] for k in ("url", "uri", "link") if isinstance(value.get(k), str)), None
        )
        if url and _is_web(url):
            title = next(
                (str(value[k]) for k in ("title", "name") if isinstance(value.get(k), str)), url
            )
            text = next(
                (
                    str(value[k])
                    for k in ("snippet", "description", "text", "content")
                    if isinstance(value.get(k), str)
                ),
                "",
            )
            found.append(Link(url, title, text))
        for v in value.values():
            found.extend(_links_in(v, depth + 1))
    elif isinstance(value, list):
        for v in value[:100]:
            found.extend(_links_in(v, depth + 1))
    return found[: MAX_LINKS * 2]


def _stripped(text: str) -> str:
    """`text` as data: nothing that closes or fakes our prompt's structure, nothing a
    store cannot keep."""
    return _STRUCTURE.sub(" ", clean(text))


def _is_web(url: str) -> bool:
    return url.startswith(("http://", "https://")) and len(url) <= 2048


def _object_schema(schema: Mapping[str, Any] | None) -> dict[str, Any]:
    """A tool's input schema as a function's parameters: an object with properties."""
    out = dict(schema or {})
    out["type"] = "object"
    out.setdefault("properties", {})
    return out


def _short(text: str, chars: int = 300) -> str:
    text = " ".join(_stripped(text).split())
    return text if len(text) <= chars else text[: chars - 1] + "…"


def _because(why: str) -> str:
    return f" ({why})" if why else ""


def _why(exc: BaseException) -> str:
    """A failure in a few words, without the URL or anything sent (they may hold secrets)."""
    if isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        return _why(exc.exceptions[0])
    if isinstance(exc, Gone):
        return str(exc)
    if isinstance(exc, TimeoutError):
        return "no answer in time"
    if isinstance(exc, TooMuch):
        return "it answered too much"
    if isinstance(exc, MCPError):
        if exc.message == "Connection closed":
            return "the connection closed"
        return "it answered an error: " + _short(exc.message, 120)
    if isinstance(exc, httpx2.HTTPStatusError):
        return f"it answered HTTP {exc.response.status_code}"
    if isinstance(exc, (httpx2.ConnectError, ConnectionRefusedError)):
        return "connection refused"
    if isinstance(exc, (httpx2.TransportError, OSError)):
        return type(exc).__name__
    return type(exc).__name__


async def _first(*waits: Any) -> None:
    """Wait until the first of `waits` is done; the others are cancelled."""
    tasks = [asyncio.ensure_future(w) for w in waits]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in tasks:
            task.cancel()


# -- the wire bound ----------------------------------------------------------------------------


class TooMuch(httpx2.TransportError):
    """A response longer than `MAX_RESPONSE_BYTES`."""


class _Bounded(httpx2.AsyncBaseTransport):
    """A transport whose POST responses stop at `MAX_RESPONSE_BYTES` (a long-lived GET
    stream of notifications is not one answer, and is not bounded)."""

    def __init__(self, inner: httpx2.AsyncBaseTransport, server: McpServer) -> None:
        self.inner = inner
        self.server = server  # counts the floods

    async def handle_async_request(self, request: httpx2.Request) -> httpx2.Response:
        response = await self.inner.handle_async_request(request)
        if request.method != "POST":
            return response
        return httpx2.Response(
            response.status_code,
            headers=response.headers,
            stream=_BoundedStream(response, self.server, _tool_called(request)),
            extensions=response.extensions,
            request=request,
        )

    async def aclose(self) -> None:
        await self.inner.aclose()


@dataclass
class _BoundedStream(httpx2.AsyncByteStream):
    response: httpx2.Response
    server: McpServer
    tool: str  # the tool it answers a call of, if any
    seen: int = field(default=0)

    async def __aiter__(self) -> AsyncIterator[bytes]:
        async for chunk in self.response.aiter_raw():
            self.seen += len(chunk)
            if self.seen > MAX_RESPONSE_BYTES:
                self.server.flooded.add(self.tool)
                raise TooMuch("the response is too long")
            yield chunk

    async def aclose(self) -> None:
        await self.response.aclose()


def _tool_called(request: httpx2.Request) -> str:
    """The tool a request calls (`tools/call`), else ""."""
    try:
        message = orjson.loads(request.content)
    except (orjson.JSONDecodeError, httpx2.RequestNotRead):
        return ""
    if isinstance(message, dict) and message.get("method") == "tools/call":
        params = message.get("params")
        return str(params.get("name", "")) if isinstance(params, dict) else ""
    return ""
