#!/usr/bin/env bash
# Installs the Node clients the OpenAI-compatible API is tested with (the `openai` SDK,
# the Vercel AI SDK `ai` and its `@ai-sdk/openai` provider, pinned in
# tests/node_clients/package.json and package-lock.json) into a cache, once, and prints
# its directory; tests/node_clients/*.mjs run with NODE_CLIENTS_HOME set to it.
#
#   NODE_CLIENTS_HOME=$(bash scripts/node_clients.sh | tail -n1) BASE_URL=... node tests/node_clients/responses.mjs
#
# Environment: XDG_CACHE_HOME (cache under $XDG_CACHE_HOME/searchchat/node-clients).
set -euo pipefail
cd "$(dirname "$0")/.."
exec bash scripts/npm_cache.sh node-clients tests/node_clients
