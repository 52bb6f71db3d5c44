"""Writing tiny GGUF files from Hugging Face checkpoints for the tests, the way llama.cpp's converter does.

Norms and biases stay float32 (as llama.cpp keeps 1-D tensors); matrices are stored in the requested
type. For the ``llama`` architecture the rows of each Q and K head are interleaved, as the converter
does for its RoPE kernel.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path

import gguf
import numpy as np
import torch
from safetensors.torch import load_file
from transformers import AutoTokenizer

_HF_TO_GGUF = {
    "model.embed_tokens": "token_embd",
    "model.norm": "output_norm",
    "lm_head": "output",
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def gguf_name(hf_name: str) -> str:
    base, suffix = hf_name.rsplit(".", 1)
    if base.startswith("model.layers."):
        layer, rest = base[len("model.layers."):].split(".", 1)
        return f"blk.{layer}.{_HF_TO_GGUF[rest]}.{suffix}"
    return f"{_HF_TO_GGUF[base]}.{suffix}"


def interleave_rotary_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's ``permute`` of Q/K rows: per head, the two rotary halves interleaved."""
    return (weight.reshape(num_heads, 2, weight.shape[0] // num_heads // 2, *weight.shape[1:])
            .swapaxes(1, 2).reshape(weight.shape))


def llama3_rope_freqs(config: dict) -> np.ndarray:
    """The ``rope_freqs`` tensor llama.cpp's converter writes for Llama 3's RoPE scaling (its own loop)."""
    scaling = config.get("rope_scaling") or config["rope_parameters"]
    base = config.get("rope_theta") or config["rope_parameters"]["rope_theta"]
    dim = config["head_dim"]
    freqs = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    factor, low_freq_factor, high_freq_factor = (scaling["factor"], scaling["low_freq_factor"],
                                                 scaling["high_freq_factor"])
    old_context_len = config.get("original_max_position_embeddings", 8192)
    low_freq_wavelen, high_freq_wavelen = old_context_len / low_freq_factor, old_context_len / high_freq_factor
    factors = []
    for freq in freqs.tolist():
        wavelen = 2 * math.pi / freq
        if wavelen < high_freq_wavelen:
            factors.append(1)
        elif wavelen > low_freq_wavelen:
            factors.append(factor)
        else:
            smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(factors, dtype=np.float32)


def hf_state_dict(model_dir: Path) -> dict[str, torch.Tensor]:
    state: dict[str, torch.Tensor] = {}
    for path in sorted(model_dir.glob("*.safetensors")):
        state.update(load_file(str(path)))
    return {name: tensor.float() for name, tensor in state.items()}


def _add_tokenizer(writer: gguf.GGUFWriter, model_dir: Path, model_type: str) -> None:
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    if model_type == "qwen2":  # transformers splits text with Qwen2's pattern; the file must say so
        writer.add_tokenizer_pre("qwen2")
    tokens = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
    special = set(tokenizer.all_special_ids)
    merges = json.loads((model_dir / "tokenizer.json").read_text())["model"]["merges"]
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types([gguf.TokenType.CONTROL if i in special else gguf.TokenType.NORMAL
                            for i in range(len(tokens))])
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in merges])
    eos = tokenizer.eos_token_id
    writer.add_bos_token_id(eos if tokenizer.bos_token_id is None else tokenizer.bos_token_id)
    writer.add_eos_token_id(eos)
    writer.add_pad_token_id(eos if tokenizer.pad_token_id is None else tokenizer.pad_token_id)
    writer.add_chat_template(tokenizer.chat_template)


def write_gguf(model_dir: Path, out_path: Path, qtype: gguf.GGMLQuantizationType = gguf.GGMLQuantizationType.F32,
               *, arch: str | None = None, overrides: dict[str, tuple[np.ndarray, gguf.GGMLQuantizationType]]
               | None = None, add_metadata: Callable[[gguf.GGUFWriter], None] | None = None) -> Path:
    """Converts the Hugging Face checkpoint in ``model_dir`` to a GGUF file with matrices in ``qtype``.

    ``arch`` overrides the file's ``general.architecture``; ``overrides`` replaces or adds tensors
    (GGUF name -> raw data and its type); ``add_metadata`` writes further keys."""
    config = json.loads((model_dir / "config.json").read_text())
    model_arch = config["model_type"]
    arch = arch or model_arch
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    writer = gguf.GGUFWriter(str(out_path), arch)
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    # newer transformers keep rope_theta under rope_parameters only
    writer.add_rope_freq_base(config.get("rope_theta") or config["rope_parameters"]["rope_theta"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_vocab_size(config["vocab_size"])
    if model_arch == "llama":
        writer.add_rope_dimension_count(config["head_dim"])
    _add_tokenizer(writer, model_dir, model_arch)
    if add_metadata is not None:
        add_metadata(writer)
    tensors: dict[str, tuple[np.ndarray, gguf.GGMLQuantizationType]] = {}
    for hf_name, tensor in hf_state_dict(model_dir).items():
        name, array = gguf_name(hf_name), tensor.numpy()
        if model_arch == "llama" and ".attn_q." in name:
            array = interleave_rotary_rows(array, heads)
        elif model_arch == "llama" and ".attn_k." in name:
            array = interleave_rotary_rows(array, kv_heads)
        tensors[name] = (array, qtype if array.ndim == 2 else gguf.GGMLQuantizationType.F32)
    if (config.get("rope_scaling") or config.get("rope_parameters") or {}).get("rope_type") == "llama3":
        tensors["rope_freqs.weight"] = (llama3_rope_freqs(config), gguf.GGMLQuantizationType.F32)
    tensors.update(overrides or {})
    for name, (array, tensor_type) in tensors.items():
        if array.dtype == np.uint8:  # already packed
            writer.add_tensor(name, array, raw_dtype=tensor_type)
        elif tensor_type in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16):
            writer.add_tensor(name, array.astype(np.float32 if tensor_type == gguf.GGMLQuantizationType.F32
                                                 else np.float16))
        else:
            writer.add_tensor(name, gguf.quants.quantize(array, tensor_type), raw_dtype=tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out_path


def write_tiny_llama(out_dir: Path, tokenizer_dir: Path, *, seed: int = 0, std: float = 0.4,
                     rope_scaling: dict | None = None, max_position_embeddings: int = 512) -> Path:
    """A tiny random Llama checkpoint (untied LM head) around the tokenizer in ``tokenizer_dir``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                         max_position_embeddings=max_position_embeddings,
                         rms_norm_eps=1e-5, rope_theta=10000.0, rope_scaling=rope_scaling, tie_word_embeddings=False,
                         bos_token_id=tokenizer.eos_token_id, eos_token_id=tokenizer.eos_token_id,
                         architectures=["LlamaForCausalLM"])
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(1.0 + 0.1 * torch.randn_like(param) if "norm" in name else std * torch.randn_like(param))
    model.save_pretrained(str(out_dir))
    tokenizer.save_pretrained(str(out_dir))
    return out_dir
