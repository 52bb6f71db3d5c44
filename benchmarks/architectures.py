"""The model shapes the benchmarks run: published Qwen2 and Llama configurations with random weights.

A benchmark needs the cost of a real model's forward pass, not its answers, so the weights are
random and nothing is downloaded. The model directory is written once per machine under the cache
directory (``$NOVAINFER_CACHE`` or ``~/.cache/novainfer``) and reused: transformers builds the
architecture's class (``Qwen2ForCausalLM(config)``, ``LlamaForCausalLM(config)``) from a fixed seed
on the benchmark's device and saves it with ``save_pretrained`` in bfloat16, next to the built-in
tiny tokenizer (prompts are token ids and outputs are not detokenized, so the tokenizer's size does
not matter). NovaInfer and the peer load the same directory, hence the same weights.
"""

from __future__ import annotations

import dataclasses
import gc
import hashlib
import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Architecture:
    """The config.json fields that decide what a forward pass costs (the rest are the defaults of
    ``architecture``'s transformers config class); ``None`` leaves a field to those defaults."""

    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    vocab_size: int
    tie_word_embeddings: bool
    max_position_embeddings: int = 32768
    rope_theta: float = 1e6
    rms_norm_eps: float = 1e-6
    architecture: str = "Qwen2ForCausalLM"
    head_dim: int | None = None
    rope_scaling: dict[str, Any] | None = None


ARCHITECTURES: dict[str, Architecture] = {
    "qwen2-0.5b": Architecture(hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                               intermediate_size=4864, vocab_size=151936, tie_word_embeddings=True),
    "qwen2-1.5b": Architecture(hidden_size=1536, num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
                               intermediate_size=8960, vocab_size=151936, tie_word_embeddings=False),
    # For tensor-parallel runs: 28 query heads and 4 KV heads split over 2 or 4 GPUs.
    "qwen2-7b": Architecture(hidden_size=3584, num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
                             intermediate_size=18944, vocab_size=152064, tie_word_embeddings=False),
    "smollm2-135m": Architecture(architecture="LlamaForCausalLM", hidden_size=576, num_hidden_layers=30,
                                 num_attention_heads=9, num_key_value_heads=3, head_dim=64, intermediate_size=1536,
                                 vocab_size=49152, tie_word_embeddings=True, max_position_embeddings=8192,
                                 rope_theta=100000.0, rms_norm_eps=1e-5),
    "llama-3.1-8b": Architecture(architecture="LlamaForCausalLM", hidden_size=4096, num_hidden_layers=32,
                                 num_attention_heads=32, num_key_value_heads=8, intermediate_size=14336,
                                 vocab_size=128256, tie_word_embeddings=False, max_position_embeddings=131072,
                                 rope_theta=500000.0, rms_norm_eps=1e-5,
                                 rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}),
}

# Architecture -> (its transformers config class, config fields every preset of it shares).
_HF_CLASSES: dict[str, tuple[str, dict[str, Any]]] = {
    "Qwen2ForCausalLM": ("Qwen2Config", {"use_sliding_window": False}),
    "LlamaForCausalLM": ("LlamaConfig", {"attention_bias": False, "mlp_bias": False}),
}

# Bumped when the way a directory is written changes, so that stale cached directories are not reused.
_FORMAT_VERSION = 1


def get_architecture(name: str, overrides: dict[str, Any] | None = None) -> Architecture:
    """The preset ``name`` with ``overrides`` (e.g. ``{"num_hidden_layers": 2}`` for a quick run) applied."""
    if name not in ARCHITECTURES:
        raise ValueError(f"architecture must be one of {sorted(ARCHITECTURES)}, got {name!r}")
    overrides = overrides or {}
    fields = {f.name for f in dataclasses.fields(Architecture)}
    unknown = sorted(set(overrides) - fields)
    if unknown:
        raise ValueError(f"architecture overrides {unknown} are not fields; valid fields are {sorted(fields)}")
    return dataclasses.replace(ARCHITECTURES[name], **overrides)


def _cache_root() -> Path:
    from novainfer.tiny_model import cache_root

    return cache_root()


def model_dir_for(name: str, arch: Architecture, device_type: str, seed: int = 0) -> Path:
    """Where the directory of this architecture lives; random draws differ between CPU and CUDA, hence the device."""
    spec = json.dumps({"arch": asdict(arch), "device": device_type, "seed": seed, "format": _FORMAT_VERSION},
                      sort_keys=True)
    digest = hashlib.sha256(spec.encode()).hexdigest()[:12]
    return _cache_root() / f"bench-{name}-{digest}"


def build_model_dir(name: str, arch: Architecture, device: Any, seed: int = 0) -> Path:
    """Returns the model directory of ``arch``, writing it first if it is not cached yet."""
    import torch

    from novainfer.tiny_model import write_once

    device = torch.device(device)
    return write_once(model_dir_for(name, arch, device.type, seed),
                      lambda tmp: _write_random_model(tmp, arch, device, seed))


def hf_config(arch: Architecture, **fields: Any):
    """The transformers config of ``arch`` (its class's defaults, then the preset's fields, then ``fields``)."""
    import transformers

    if arch.architecture not in _HF_CLASSES:
        raise ValueError(f"architecture must be one of {sorted(_HF_CLASSES)}, got {arch.architecture!r}")
    config_class, shared = _HF_CLASSES[arch.architecture]
    preset = {k: v for k, v in asdict(arch).items() if k != "architecture" and v is not None}
    return getattr(transformers, config_class)(**{**shared, **preset, "hidden_act": "silu",
                                                  "architectures": [arch.architecture], **fields})


def _write_random_model(out_dir: Path, arch: Architecture, device: Any, seed: int) -> None:
    import torch
    import transformers

    from novainfer.tiny_model import build_tokenizer

    tokenizer = build_tokenizer(out_dir)
    eos = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    config = hf_config(arch, bos_token_id=eos, eos_token_id=eos, dtype="bfloat16")
    torch.manual_seed(seed)  # seeds the CUDA generators too
    with torch.device(device):  # initialise on the device: the 7B model takes minutes on a CPU
        model = getattr(transformers, arch.architecture)(config)
    model.to(torch.bfloat16).save_pretrained(str(out_dir))
    del model
    gc.collect()
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()
