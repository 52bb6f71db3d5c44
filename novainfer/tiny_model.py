"""The built-in tiny model: a random-weight Qwen2 (or Llama) with a tokenizer of our own making.

It is written in exactly the Hugging Face layout of a real checkpoint (``config.json``,
``*.safetensors``, tokenizer files, ``generation_config.json``) so that the default path of every
command exercises the real loader. Tests build variants of it with other configurations.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

CHATML_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

# Text the tokenizer's byte-level BPE merges are learned from: some English, code and Chinese,
# so that common words become single tokens and any other text still encodes byte by byte.
_CORPUS = """
The quick brown fox jumps over the lazy dog. A language model predicts the next token of a text.
Inference engines batch many requests together, cache keys and values in paged blocks, and stream
tokens back to their clients as soon as they are sampled. Hello, world! How are you today?
Once upon a time there was a small model that wanted to learn how to speak. It read books about
history, science, music and mathematics, and it answered questions politely and briefly.
def generate(prompt, max_tokens=16):
    tokens = tokenizer.encode(prompt)
    for _ in range(max_tokens):
        tokens.append(model.next_token(tokens))
    return tokenizer.decode(tokens)
你好，世界！今天天气很好。我们一起学习语言模型的推理。这是一个小模型，它会说中文和英文。
北京是中国的首都。上海是一个大城市。请问你叫什么名字？我很高兴认识你。
Numbers: 0 1 2 3 4 5 6 7 8 9 10 100 1000 2024 3.14159. Symbols: + - * / = < > ( ) [ ] { } # @ !
"""

TINY_QWEN2_CONFIG: dict[str, Any] = {
    "architectures": ["Qwen2ForCausalLM"],
    "model_type": "qwen2",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "hidden_act": "silu",
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "tie_word_embeddings": True,
    "use_sliding_window": False,
    "torch_dtype": "float32",
}

# Shaped like Llama 3.1 (untied, llama3 RoPE scaling), with head_dim != hidden_size / heads.
TINY_LLAMA_CONFIG: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "hidden_act": "silu",
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 256},
    "attention_bias": False,
    "mlp_bias": False,
    "tie_word_embeddings": False,
    "torch_dtype": "float32",
}

TINY_CONFIGS: dict[str, dict[str, Any]] = {"qwen2": TINY_QWEN2_CONFIG, "llama": TINY_LLAMA_CONFIG}

TOKENIZER_VOCAB_SIZE = 1024


def build_tokenizer(out_dir: str | Path, vocab_size: int = TOKENIZER_VOCAB_SIZE):
    """Trains a byte-level BPE tokenizer on the built-in corpus and saves it in Hugging Face format."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([line for line in _CORPUS.splitlines() if line.strip()] * 4, trainer=trainer)
    hf_tok = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|endoftext|>",
                                     additional_special_tokens=["<|im_start|>", "<|im_end|>"])
    hf_tok.chat_template = CHATML_TEMPLATE
    hf_tok.save_pretrained(str(out_dir))
    return hf_tok


def _random_state_dict(config: dict[str, Any], seed: int, std: float) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint of ``config``'s architecture, drawn from N(0, std)."""
    from types import SimpleNamespace

    from novainfer.models.registry import ModelRegistry

    model_cls, _ = ModelRegistry.resolve(config["architectures"])
    options = model_cls.decoder_options(SimpleNamespace(**config))  # which projections have a bias
    gen = torch.Generator().manual_seed(seed)
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config.get("head_dim") or hidden // heads

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * std

    def norm_weight() -> torch.Tensor:
        # Not all ones, so that a norm applied with the wrong weight shows up in parity tests.
        return 1.0 + 0.1 * torch.randn(hidden, generator=gen)

    def linear(name: str, out_features: int, in_features: int, bias: bool) -> dict[str, torch.Tensor]:
        tensors = {f"{name}.weight": randn(out_features, in_features)}
        if bias:
            tensors[f"{name}.bias"] = randn(out_features)
        return tensors

    state = {"model.embed_tokens.weight": randn(config["vocab_size"], hidden)}
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}"
        for name, size in (("q_proj", heads * head_dim), ("k_proj", kv_heads * head_dim),
                           ("v_proj", kv_heads * head_dim)):
            state.update(linear(f"{p}.self_attn.{name}", size, hidden, options.qkv_bias))
        state.update(linear(f"{p}.self_attn.o_proj", hidden, heads * head_dim, options.o_proj_bias))
        state.update(linear(f"{p}.mlp.gate_proj", inter, hidden, options.mlp_bias))
        state.update(linear(f"{p}.mlp.up_proj", inter, hidden, options.mlp_bias))
        state.update(linear(f"{p}.mlp.down_proj", hidden, inter, options.mlp_bias))
        state[f"{p}.input_layernorm.weight"] = norm_weight()
        state[f"{p}.post_attention_layernorm.weight"] = norm_weight()
    state["model.norm.weight"] = norm_weight()
    if not config.get("tie_word_embeddings", False):
        state["lm_head.weight"] = randn(config["vocab_size"], hidden)
    return state


def _save_sharded(state: dict[str, torch.Tensor], out_dir: Path, num_shards: int) -> None:
    if num_shards == 1:
        save_file(state, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
        return
    names = list(state)
    weight_map = {}
    for shard in range(num_shards):
        file_name = f"model-{shard + 1:05d}-of-{num_shards:05d}.safetensors"
        part = {n: state[n] for n in names[shard::num_shards]}
        save_file(part, str(out_dir / file_name), metadata={"format": "pt"})
        weight_map.update({n: file_name for n in part})
    total = sum(t.numel() * t.element_size() for t in state.values())
    (out_dir / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))


def write_random_model(out_dir: str | Path, *, arch: str = "qwen2", seed: int = 0, std: float = 0.4,
                       num_shards: int = 1, tokenizer_dir: str | Path | None = None, dtype: str = "float32",
                       **config_overrides: Any) -> Path:
    """Writes a random-weight checkpoint directory of ``arch`` (a key of :data:`TINY_CONFIGS`) and
    returns its path.

    ``tokenizer_dir``: copy that tokenizer (e.g. a real Qwen2 one) instead of training ours; the
    vocabulary size follows the tokenizer unless ``vocab_size`` is given. ``config_overrides``
    replace entries of the architecture's tiny config. Weights are drawn from N(0, std) in float32
    and stored as ``dtype``.
    """
    if arch not in TINY_CONFIGS:
        raise ValueError(f"arch must be one of {sorted(TINY_CONFIGS)}, got {arch!r}")
    from transformers import AutoTokenizer

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    if tokenizer_dir is None:
        tokenizer = build_tokenizer(out_dir)
    else:
        tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
        tokenizer.save_pretrained(str(out_dir))
    config = {**TINY_CONFIGS[arch], "vocab_size": len(tokenizer), "torch_dtype": dtype, **config_overrides}
    if config["vocab_size"] < len(tokenizer):
        raise ValueError(f"vocab_size {config['vocab_size']} is smaller than the tokenizer ({len(tokenizer)} tokens)")
    special = {t: tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS if t in tokenizer.get_vocab()}
    eos_ids = [special[t] for t in ("<|im_end|>", "<|endoftext|>") if t in special]
    config.setdefault("bos_token_id", special.get("<|endoftext|>"))
    config.setdefault("eos_token_id", special.get("<|endoftext|>"))
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    (out_dir / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": config["bos_token_id"], "eos_token_id": eos_ids, "do_sample": False}, indent=2))
    state = _random_state_dict(config, seed, std)
    torch_dtype = getattr(torch, dtype)
    _save_sharded({k: v.to(torch_dtype).contiguous() for k, v in state.items()}, out_dir, num_shards)
    return out_dir


def write_random_qwen2(out_dir: str | Path, **kwargs: Any) -> Path:
    """:func:`write_random_model` of the tiny Qwen2."""
    return write_random_model(out_dir, arch="qwen2", **kwargs)


def write_mock_model(out_dir: str | Path, max_position_embeddings: int = 512) -> Path:
    """Writes a directory for the registry's mock model (next token = last token + 1)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(out_dir)
    config = {"architectures": ["NovaInferMockForCausalLM"], "model_type": "qwen2", "vocab_size": len(tokenizer),
              "hidden_size": 8, "num_attention_heads": 1, "num_key_value_heads": 1, "num_hidden_layers": 1,
              "max_position_embeddings": max_position_embeddings, "torch_dtype": "float32"}
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    save_file({"logit_scale": torch.ones(1)}, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    return out_dir


def cache_root() -> Path:
    return Path(os.environ.get("NOVAINFER_CACHE", Path.home() / ".cache" / "novainfer"))


def get_tiny_model_dir(arch: str = "qwen2", **overrides: Any) -> Path:
    """The directory of the built-in tiny model of ``arch`` (or a variant), written on first use.

    Writing goes to a temporary directory that is renamed into place, so concurrent callers
    (parallel test workers) never see a half-written model.
    """
    if arch not in TINY_CONFIGS:
        raise ValueError(f"arch must be one of {sorted(TINY_CONFIGS)}, got {arch!r}")
    spec = json.dumps({"config": TINY_CONFIGS[arch], "overrides": overrides, "vocab": TOKENIZER_VOCAB_SIZE,
                       "format": 1}, sort_keys=True, default=str)
    digest = hashlib.sha256(spec.encode()).hexdigest()[:12]
    return write_once(cache_root() / f"tiny-{arch}-{digest}",
                      lambda tmp: write_random_model(tmp, arch=arch, **overrides))


def write_once(target: Path, write: Callable[[Path], object], marker: str = "config.json") -> Path:
    """``target``, first filled by ``write(directory)`` unless it already holds a file ``marker``.

    Writing goes to a temporary directory that is renamed into place, so concurrent callers never
    see a half-written model and an interrupted write leaves nothing that looks complete.
    """
    if (target / marker).is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        write(tmp)
        try:
            os.rename(tmp, target)
        except OSError:  # another caller finished first
            if not (target / marker).is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target
