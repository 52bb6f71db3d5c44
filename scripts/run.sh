#!/usr/bin/env bash
# Installs NovaInfer, then serves the built-in tiny model (written on first use) with the
# OpenAI-compatible API on http://127.0.0.1:8000. Extra arguments go to `novainfer serve`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
exec novainfer serve "$@"
