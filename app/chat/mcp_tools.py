"""The tools of the configured MCP servers as research tools (PROTOCOL §14 client): one
`ToolSet` over `McpServers`, offered as `<server>__<tool>` with the server's own schema.

A server's tools are offered to a research when the server is `default` or the request's
`sources` names `mcp:<server>`, from what it listed last (a server that is down is tried,
and fails at once). Each call is a `progress` step of kind `tool`
(`{"server", "tool", "status"}`) that ends `failed` with why when the server is down, slow
past its `timeout_seconds`, answers an error or too much; the research goes on. What a
call returns reaches the model as a tool message only, bounded and stripped
(`mcp_client.result_of`); its web links become sources (`metadata.tool`).
"""

from __future__ import annotations

from typing import Any

from ..mcp_client import McpServer, McpServers, ToolCallFailed
from ..results import SearchResult
from .tools import Research

#: characters of a link's text kept as its source's snippet
SNIPPET_CHARS = 500


class McpTools:
    """The MCP servers' tools, as one set of the research agent's tools."""

    def __init__(self, servers: McpServers) -> None:
        self.servers = servers

    def schemas(self, job: Research) -> list[dict[str, Any]]:
        return [
            tool.function()
            for server in self.servers.servers.values()
            if self._offered(server, job)
            for tool in server.tools
        ]

    def owns(self, name: str) -> bool:
        return self.servers.tool(name) is not None

    async def run(self, job: Research, name: str, args: dict[str, Any]) -> str:
        found = self.servers.tool(name)
        if found is None or not self._offered(found[0], job):
            return f"there is no tool {name[:40]!r} here"
        server, tool = found
        with job.steps.running(
            "tool", f"asking {server.name}: {tool.name}", server=server.name, tool=tool.name
        ) as step:
            try:
                result = await server.call(tool, args)
            except ToolCallFailed as exc:
                job.steps.end(
                    step, f"{server.name}: {tool.name} failed: {exc}", "failed", error=str(exc)
                )
                return f"the tool failed: {exc}"
            found_sources = job.keep(
                [
                    SearchResult(
                        link.title or link.url, link.url, link.text[:SNIPPET_CHARS], tool=name
                    )
                    for link in result.links
                ]
            )
            said = f"{server.name}: {tool.name} answered" + (
                f", {len(found_sources)} sources" if found_sources else ""
            )
            if result.truncated:
                job.steps.end(
                    step, said + " (cut short)", sources=len(found_sources), truncated=True
                )
            else:
                job.steps.end(step, said, sources=len(found_sources))
        return result.text or "(the tool returned nothing)"

    @staticmethod
    def _offered(server: McpServer, job: Research) -> bool:
        return server.settings.default or server.name in job.servers
