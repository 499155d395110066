# Sourced by the scripts that need Node: installs nodejs and npm with apt when `node` or
# `npm` is missing (the apt output goes to stderr), then sets node_major.
#
#   source "$(dirname "$0")/node.sh"
if ! command -v node >/dev/null 2>&1 || ! command -v npm >/dev/null 2>&1; then
  echo "$(basename "$0"): node or npm is missing, installing nodejs and npm with apt" >&2
  sudo=""
  [ "$(id -u)" -eq 0 ] || sudo="sudo"
  {
    $sudo apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq nodejs npm
  } >&2
fi
node_major=$(node -p 'process.versions.node.split(".")[0]')
