"""Helpers shared by tests: building tiny models and asking transformers (the oracle) for answers."""

from __future__ import annotations

import copy
import functools
import random
from pathlib import Path

import torch
from transformers.utils import logging as transformers_logging

from novainfer.tiny_model import get_tiny_model_dir
from tests._tokenizers import QWEN2_TOKENIZER_DIR


# A small explicit KV budget: on CPU the default budget is 1 GiB, needless for a tiny model.
SMALL_KV = 1 << 22


def tiny_model(**overrides) -> Path:
    """A cached tiny random Qwen2 variant (written once per machine, shared by test workers)."""
    return get_tiny_model_dir(**overrides)


# Fixtures ``model_dir`` (the default tiny model) and ``vocab_size`` (its vocabulary size): a test
# module uses them by importing them.
def random_ids(rng: random.Random | int, n: int, vocab_size: int) -> list[int]:
    """``n`` random token ids, none of them special, drawn from ``rng`` (or a ``Random`` of that seed)."""
    if not isinstance(rng, random.Random):
        rng = random.Random(rng)
    # Ids 0-2 are the tiny tokenizer's special tokens. Id 0 is also the pad id that hf_greedy
    # hands transformers, which then masks every prompt position holding it: avoid them.
    return [rng.randrange(3, vocab_size) for _ in range(n)]


def qwen2_tokenizer_model(**overrides) -> Path:
    """A tiny random model around the real Qwen2 tokenizer (callers skip when it is absent)."""
    return get_tiny_model_dir(tokenizer_dir=str(QWEN2_TOKENIZER_DIR), **overrides)


@functools.lru_cache(maxsize=8)
def hf_model(path: Path, dtype: torch.dtype = torch.float32, device: str = "cpu"):
    """transformers' model of a checkpoint directory or of a .gguf file (which it reads on its own)."""
    from transformers import AutoModelForCausalLM

    path = Path(path)
    location = {"pretrained_model_name_or_path": str(path.parent), "gguf_file": path.name} \
        if path.suffix == ".gguf" else {"pretrained_model_name_or_path": str(path)}
    return AutoModelForCausalLM.from_pretrained(**location, dtype=dtype).to(device).eval()


@torch.inference_mode()
def hf_logits(path: Path, token_ids: list[int], dtype: torch.dtype = torch.float32, device: str = "cpu") -> torch.Tensor:
    """transformers' logits [len, vocab] for one prompt on its own."""
    return hf_model(path, dtype, device)(torch.tensor([token_ids], device=device)).logits[0].float()


@torch.inference_mode()
def hf_greedy(path: Path, token_ids: list[int], max_new_tokens: int, dtype: torch.dtype = torch.float32,
              device: str = "cpu") -> list[int]:
    """transformers' greedy ``generate`` for one prompt alone, never stopping early at EOS."""
    model = hf_model(path, dtype, device)
    config = copy.deepcopy(model.generation_config)
    config.do_sample = False
    config.max_new_tokens = max_new_tokens
    # An id no token has: generation runs to max_new_tokens (None falls back to the model's EOS).
    config.eos_token_id = -1
    config.pad_token_id = 0
    verbosity = transformers_logging.get_verbosity()
    transformers_logging.set_verbosity_error()  # it warns that -1 is not a real token id
    try:
        input_ids = torch.tensor([token_ids], device=device)
        # An explicit mask: otherwise prompt tokens equal to pad_token_id would be masked out.
        out = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), generation_config=config)
    finally:
        transformers_logging.set_verbosity(verbosity)
    new_tokens = out[0, len(token_ids):].tolist()
    assert len(new_tokens) == max_new_tokens, "transformers stopped early: EOS was not disabled"
    return new_tokens
