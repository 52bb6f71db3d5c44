"""Helpers shared by tests: building tiny models and asking transformers (the oracle) for answers."""

from __future__ import annotations

import copy
import functools
import hashlib
import json
import random
from pathlib import Path

import torch
from transformers.utils import logging as transformers_logging

from novainfer.tiny_model import build_tokenizer, cache_root, get_tiny_model_dir, write_once
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


# The base of the Llama variants that transformers itself builds (``transformers_llama``).
TINY_HF_LLAMA = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-5, rope_theta=10000.0,
                     tie_word_embeddings=False)


def transformers_llama(**overrides) -> Path:
    """A tiny random Llama written by transformers (``LlamaConfig`` + ``LlamaForCausalLM``, saved with
    ``save_pretrained``) next to the tiny tokenizer: its config spelling and checkpoint names are
    transformers' own, not our writer's. Cached like :func:`tiny_model`."""
    import transformers

    config = {**TINY_HF_LLAMA, **overrides}
    spec = json.dumps({"config": config, "transformers": transformers.__version__, "format": 1}, sort_keys=True)
    digest = hashlib.sha256(spec.encode()).hexdigest()[:12]
    return write_once(cache_root() / f"tiny-hf-llama-{digest}", lambda tmp: _write_transformers_llama(tmp, config))


def _write_transformers_llama(out_dir: Path, config: dict, seed: int = 0, std: float = 0.4) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = build_tokenizer(out_dir)
    eos = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    model = LlamaForCausalLM(LlamaConfig(vocab_size=len(tokenizer), bos_token_id=eos, eos_token_id=eos, **config))
    # transformers initialises with std 0.02: near-uniform logits whose greedy choices are near-ties
    # that summation order decides. Larger weights make every choice clear.
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=gen)
            param.copy_(1.0 + 0.1 * noise if name.endswith("norm.weight") else std * noise)
    model.save_pretrained(str(out_dir))


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
    """transformers' logits [len, vocab] for one prompt on its own, in float32 or wider."""
    logits = hf_model(path, dtype, device)(torch.tensor([token_ids], device=device)).logits[0]
    return logits.to(torch.promote_types(logits.dtype, torch.float32))


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
