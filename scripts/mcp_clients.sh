#!/usr/bin/env bash
# Installs the MCP clients /mcp is tested with (the TypeScript SDK
# `@modelcontextprotocol/sdk` and the MCP Inspector, pinned in tests/mcp_clients/package.json
# and package-lock.json) into a cache, once, and prints its directory; tests/mcp_clients/*.mjs
# run with MCP_CLIENTS_HOME set to it.
#
#   MCP_CLIENTS_HOME=$(bash scripts/mcp_clients.sh | tail -n1) URL=http://HOST:PORT/mcp node tests/mcp_clients/sdk.mjs
#
# Environment: XDG_CACHE_HOME (cache under $XDG_CACHE_HOME/searchchat/mcp-clients).
set -euo pipefail
cd "$(dirname "$0")/.."
exec bash scripts/npm_cache.sh mcp-clients tests/mcp_clients
