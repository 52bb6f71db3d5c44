#!/usr/bin/env bash
# Installs NovaInfer, then generates text with the built-in tiny model (written on first use).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
exec novainfer generate --prompt "${PROMPT:-Hello, my name is}" --max-tokens "${MAX_TOKENS:-32}" "$@"
