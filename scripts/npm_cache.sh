#!/usr/bin/env bash
# Installs the npm packages pinned in <dir>/package.json and package-lock.json into a
# cache, once, and prints the directory they are in (its node_modules). A later call
# with the same package files and Node major version only prints the path.
#
#   home=$(bash scripts/npm_cache.sh <name> <dir> | tail -n1)
#
# Environment: XDG_CACHE_HOME (cache under $XDG_CACHE_HOME/searchchat/<name>).
# Node and npm come from apt when `node` is missing. Everything but the path goes to stderr.
set -euo pipefail
name=$1
src=$(cd "$2" && pwd)

# shellcheck source=scripts/node.sh
source "$(dirname "${BASH_SOURCE[0]}")/node.sh"

key=$(
  { cat "$src/package.json" "$src/package-lock.json"; printf 'node=%s\n' "$node_major"; } |
    sha256sum | cut -c1-16
)
cache=${XDG_CACHE_HOME:-$HOME/.cache}/searchchat/$name
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
echo "npm_cache.sh: installing $name into $ready (once)" >&2
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
