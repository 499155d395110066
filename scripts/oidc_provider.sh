#!/usr/bin/env bash
# Installs the OpenID Connect provider the sign-in tests run (npm's oidc-provider, pinned
# in tests/oidc/package.json and package-lock.json) into a cache, once, and prints its
# directory; tests/oidc/provider.mjs runs with OIDC_PROVIDER_HOME set to it. A later call
# with the same package files and Node major version only prints the path.
#
#   OIDC_PROVIDER_HOME=$(bash scripts/oidc_provider.sh | tail -n1) PORT=9000 ... node tests/oidc/provider.mjs
#
# Environment: XDG_CACHE_HOME (cache under $XDG_CACHE_HOME/searchchat/oidc-provider).
# Node and npm come from apt when `node` is missing. Everything but the path goes to stderr.
set -euo pipefail
cd "$(dirname "$0")/.."
if command -v node >/dev/null 2>&1; then
  node_major=$(node -p 'process.versions.node.split(".")[0]')
  if [ "$node_major" -lt 20 ]; then
    echo "oidc_provider.sh: Node $(node --version) is too old, oidc-provider 9 needs Node 20.19+" >&2
    exit 2
  fi
fi
exec bash scripts/npm_cache.sh oidc-provider tests/oidc
