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
src=$PWD/tests/oidc

if ! command -v node >/dev/null 2>&1 || ! command -v npm >/dev/null 2>&1; then
  echo "oidc_provider.sh: node or npm is missing, installing nodejs and npm with apt" >&2
  sudo=""
  [ "$(id -u)" -eq 0 ] || sudo="sudo"
  {
    $sudo apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq nodejs npm
  } >&2
fi
node_major=$(node -p 'process.versions.node.split(".")[0]')
if [ "$node_major" -lt 20 ]; then
  echo "oidc_provider.sh: Node $(node --version) is too old, oidc-provider 9 needs Node 20.19+" >&2
  exit 2
fi

key=$(
  { cat "$src/package.json" "$src/package-lock.json"; printf 'node=%s\n' "$node_major"; } |
    sha256sum | cut -c1-16
)
cache=${XDG_CACHE_HOME:-$HOME/.cache}/searchchat/oidc-provider
ready=$cache/$key
if [ -f "$ready/.installed" ]; then
  echo "$ready"
  exit 0
fi

mkdir -p "$cache"
exec 9>"$cache/.lock"
if command -v flock >/dev/null 2>&1; then
  flock 9
fi
if [ -f "$ready/.installed" ]; then
  echo "$ready"
  exit 0
fi
echo "oidc_provider.sh: installing oidc-provider into $ready (once)" >&2
scratch=$(mktemp -d "$cache/.install-$key-XXXXXX")
trap 'rm -rf "$scratch"' EXIT
cp "$src/package.json" "$src/package-lock.json" "$scratch/"
(cd "$scratch" && npm ci --no-audit --no-fund --ignore-scripts --loglevel=error) >&2
touch "$scratch/.installed"
rm -rf "$ready"
mv -T "$scratch" "$ready"
trap - EXIT
# installs of other keys are of no use any more
find "$cache" -mindepth 1 -maxdepth 1 ! -name "$key" ! -name .lock -exec rm -rf {} + 2>/dev/null || true
echo "$ready"
