"""Loading a model's tokenizer from a local Hugging Face directory or a GGUF file."""

from __future__ import annotations

import os
from pathlib import Path

from novainfer.model_loader.gguf import derived_once, is_gguf_file


def get_tokenizer(path: str | os.PathLike):
    """The tokenizer (with its chat template) of a model directory, or the one a GGUF file's metadata
    describes: converted by transformers once, then loaded from the cache (see ``derived_once``),
    which takes about 0.1 s where the conversion took 4 s for SmolLM2's 49,152 tokens on a CPU."""
    from transformers import AutoTokenizer

    path = Path(path)
    if not is_gguf_file(path):
        return AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    directory = derived_once(path, "tokenizer", lambda d: _convert_gguf_tokenizer(path).save_pretrained(d),
                             marker="tokenizer_config.json")
    if directory is None:
        return _convert_gguf_tokenizer(path)
    return AutoTokenizer.from_pretrained(str(directory), local_files_only=True)


def _convert_gguf_tokenizer(path: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name, local_files_only=True)
