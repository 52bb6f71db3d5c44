#!/usr/bin/env bash
# Installs NovaInfer (editable) and its dependencies into the current Python environment.
# Usage: scripts/install.sh [EXTRAS]   e.g. scripts/install.sh test
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if ! "$PYTHON" -c "import torch" >/dev/null 2>&1; then
  # No torch yet: this is a CPU machine. Pin the CPU build explicitly so that pip never
  # resolves torch through a dependency range and pulls gigabytes of CUDA packages.
  "$PYTHON" -m pip install --quiet "torch==2.13.0"
fi
target="."
if [ -n "${1:-}" ]; then target=".[$1]"; fi
"$PYTHON" -m pip install --quiet -e "$target"
