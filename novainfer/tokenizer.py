"""Loading a model's tokenizer from a local Hugging Face directory or a GGUF file."""

from __future__ import annotations

import os
from pathlib import Path

from novainfer.model_loader.gguf import is_gguf_file


def get_tokenizer(path: str | os.PathLike):
    """The tokenizer (with its chat template) of a model directory, or the one a GGUF file's metadata describes."""
    from transformers import AutoTokenizer

    path = Path(path)
    if is_gguf_file(path):
        return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name, local_files_only=True)
    return AutoTokenizer.from_pretrained(str(path), local_files_only=True)
