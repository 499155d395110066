#!/usr/bin/env bash
# Installs the MCP server the research agent's MCP client is tested with (the reference
# `@modelcontextprotocol/server-everything`, pinned in tests/mcp_servers/package.json and
# package-lock.json) into a cache, once, and prints its directory.
#
#   home=$(bash scripts/mcp_servers.sh | tail -n1)
#   PORT=3001 node "$home/node_modules/@modelcontextprotocol/server-everything/dist/index.js" streamableHttp
#
# Environment: XDG_CACHE_HOME (cache under $XDG_CACHE_HOME/searchchat/mcp-servers).
set -euo pipefail
cd "$(dirname "$0")/.."
exec bash scripts/npm_cache.sh mcp-servers tests/mcp_servers
