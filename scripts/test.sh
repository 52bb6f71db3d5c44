#!/usr/bin/env bash
# Installs NovaInfer with its test dependencies, then runs the test suite.
# pytest exits non-zero when a test fails and when no test ran at all.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh test
exec python3 -m pytest -q "$@"
