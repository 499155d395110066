#!/usr/bin/env bash
# Sets up and runs the test suite on a new machine (Debian/Ubuntu, Python 3.11+):
# a virtualenv with the package and its test extras, and what the tests start
# on loopback (redis-server — one Redis, a Redis Cluster, and `redis-server --sentinel`
# for Redis Sentinel —, PostgreSQL, nginx) or drive (Debian's Chromium, through
# Playwright — never Playwright's own browser download), then ruff, mypy (strict,
# on app/), the docs site (mkdocs build --strict: no broken link) and pytest.
# Extra arguments go to pytest: scripts/test.sh -k cancel -x (-n 0: in one process)
set -euo pipefail
cd "$(dirname "$0")/.."

python=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$python" -m venv .venv
.venv/bin/pip install -q --disable-pip-version-check -e '.[test,docs]'

missing=()
command -v redis-server >/dev/null 2>&1 || missing+=(redis-server)
[ -x /usr/sbin/nginx ] || missing+=(nginx)
[ -x /usr/bin/chromium ] || missing+=(chromium)
if ! command -v initdb >/dev/null 2>&1 && ! ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1; then
  missing+=(postgresql)
fi
if [ ${#missing[@]} -gt 0 ]; then
  sudo=""
  [ "$(id -u)" -eq 0 ] || sudo="sudo"
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "${missing[@]}" >/dev/null
fi

# a real model for the tests marked real_model: llama-cpp-python's server and Gemma 3 270M,
# built once into ~/.cache/searchchat/real-model (several minutes the first time)
bash scripts/real_model.sh >/dev/null

.venv/bin/ruff check app tests bench
.venv/bin/ruff format --check --quiet app tests bench
# mypy keeps its cache beside the model: a second run checks only what changed
.venv/bin/mypy --cache-dir "${XDG_CACHE_HOME:-$HOME/.cache}/searchchat/mypy"
site=$(mktemp -d)  # the docs site, built where it is thrown away: a broken link fails here
NO_MKDOCS_2_WARNING=1 .venv/bin/mkdocs build --strict --site-dir "$site"
rm -rf "$site"
# two workers, each running whole files (their module fixtures shared): the suite waits
# on servers more than it computes (0.85 of a core in one process); `-n 0` for one process
exec .venv/bin/python -m pytest -n 2 --dist loadfile "$@"
