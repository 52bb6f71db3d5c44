"""Shared loader for the real Qwen2 tokenizer used by the text-processing tests."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest

QWEN2_TOKENIZER_DIR = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "qwen2_tokenizer"


@functools.cache
def _load(path: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def load_qwen2_tokenizer():
    """Returns the Qwen2 fast tokenizer (loaded once per process), or skips the test."""
    if not QWEN2_TOKENIZER_DIR.is_dir():
        pytest.skip(f"Qwen2 tokenizer not found at {QWEN2_TOKENIZER_DIR}")
    return _load(QWEN2_TOKENIZER_DIR)
