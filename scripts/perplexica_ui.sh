#!/usr/bin/env bash
# Builds Perplexica's web UI (clients/perplexica-ui, docs/protocol.md §9) against
# this server on 127.0.0.1:18080, once, and caches the build: a later call with the same
# UI source, lockfile, Node major version and baked-in addresses only prints the path.
#
#   bash scripts/perplexica_ui.sh          # → last line of stdout: the built UI's directory
#   cd "$(bash scripts/perplexica_ui.sh | tail -n1)" &&
#     node node_modules/next/dist/bin/next start -p 3000 -H 127.0.0.1
#
# Environment: PERPLEXICA_UI_SRC (the UI's source, default clients/perplexica-ui), XDG_CACHE_HOME (cache under $XDG_CACHE_HOME/searchchat/perplexica-ui).
# Node and npm come from apt when `node` is missing; yarn 1 through npx. Everything but the
# path goes to stderr.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD

# the addresses are inlined into the UI's JavaScript at build time: a build talks to one port
api_url="http://127.0.0.1:18080/api"
ws_url="ws://127.0.0.1:18080"
yarn="yarn@1.22.22"

src=${PERPLEXICA_UI_SRC:-$root/clients/perplexica-ui}
if [ ! -f "$src/package.json" ] || [ ! -f "$src/yarn.lock" ]; then
  echo "perplexica_ui.sh: no Perplexica UI source at $src (set PERPLEXICA_UI_SRC)" >&2
  exit 2
fi
src=$(cd "$src" && pwd)

# shellcheck source=scripts/node.sh
source "$(dirname "${BASH_SOURCE[0]}")/node.sh"
if [ "$node_major" -lt 18 ]; then
  echo "perplexica_ui.sh: Node $(node --version) is too old, the UI (Next.js 14) needs Node 18+" >&2
  exit 2
fi

# the key: every file of the UI's source (yarn.lock and package.json among them, by path and
# content), the baked-in addresses, the yarn version and Node's major version
key=$(
  {
    (cd "$src" && find . -type f ! -path './node_modules/*' ! -path './.next/*' -print0 |
      LC_ALL=C sort -z | xargs -0 sha256sum)
    printf 'api=%s\nws=%s\nyarn=%s\nnode=%s\n' "$api_url" "$ws_url" "$yarn" "$node_major"
  } | sha256sum | cut -c1-16
)
cache=${XDG_CACHE_HOME:-$HOME/.cache}/searchchat/perplexica-ui
ready=$cache/$key
if [ -f "$ready/.next/BUILD_ID" ]; then
  echo "$ready"
  exit 0
fi

mkdir -p "$cache"
# one build at a time per cache (a second run waits, then finds the first one's build)
exec 9>"$cache/.lock"
if command -v flock >/dev/null 2>&1; then
  flock 9
fi
if [ -f "$ready/.next/BUILD_ID" ]; then
  echo "$ready"
  exit 0
fi

echo "perplexica_ui.sh: building the Perplexica UI from $src into $ready (a few minutes, once)" >&2
scratch=$(mktemp -d "$cache/.build-$key-XXXXXX")
trap 'rm -rf "$scratch"' EXIT
# the source may be read-only: copy without node_modules/.next, then make it writable
(cd "$src" && tar -cf - --exclude=./node_modules --exclude=./.next .) | (cd "$scratch" && tar -xf -)
chmod -R u+w "$scratch"
(
  cd "$scratch"
  export NEXT_TELEMETRY_DISABLED=1
  npx --yes "$yarn" install --frozen-lockfile --non-interactive --network-timeout 600000
  NEXT_PUBLIC_API_URL=$api_url NEXT_PUBLIC_WS_URL=$ws_url \
    NEXT_FONT_GOOGLE_MOCKED_RESPONSES=$PWD/font-mock.js \
    npx --yes "$yarn" build
) >&2
if [ ! -f "$scratch/.next/BUILD_ID" ]; then
  echo "perplexica_ui.sh: the build finished without .next/BUILD_ID" >&2
  exit 1
fi
# into place in one rename; an incomplete entry of the same key (no BUILD_ID) is replaced
if [ -e "$ready" ]; then
  rm -rf "$ready"
fi
mv -T "$scratch" "$ready"
trap - EXIT
# builds of other keys (an older UI copy or lockfile) are dead weight of ~800 MB each
find "$cache" -mindepth 1 -maxdepth 1 ! -name "$key" ! -name .lock -exec rm -rf {} + 2>/dev/null || true
echo "$ready"
