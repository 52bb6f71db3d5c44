"""The core_api examples run on the built-in tiny model (as a user would start them), and the two
that can check themselves recompute their results the plain way (--check)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.utils import tiny_model

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"

CASES = {
    "core_api_parallel.py": ["--n", "3", "--max-tokens", "6", "--check"],
    "core_api_beam_search.py": ["--width", "3", "--max-tokens", "5", "--check"],
    "core_api_context_shift.py": ["--n-ctx", "80", "--max-tokens", "24", "--turns", "Hello", "Tell me more"],
}


@pytest.mark.parametrize("script", sorted(CASES))
def test_example_runs(script):
    tiny_model()  # written once here, not raced by the subprocess
    result = subprocess.run([sys.executable, str(EXAMPLES / script), "--device", "cpu", *CASES[script]],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    out = result.stdout
    if "--check" in CASES[script]:
        assert "check:" in out and "check failed" not in out
    if script == "core_api_parallel.py":
        assert "cells used: 22 = prompt 4 + 3 x 6 new (4 cells shared by all 3 sequences)" in out
    if script == "core_api_context_shift.py":
        assert "[context shift: kept" in out and out.count("> ") == 2
