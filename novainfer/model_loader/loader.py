"""Building a registered model and filling its parameters from a checkpoint.

Checkpoint names are mapped to parameters through the model's ``packed_modules_mapping``
(e.g. ``q_proj`` -> shard "q" of ``qkv_proj``); each parameter's ``weight_loader`` keeps this
rank's shard. Every checkpoint tensor must be used and every parameter filled: anything
missing or unexpected is an error that names it.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import torch
from torch import nn

from novainfer.model_loader.gguf import is_gguf_file, iterate_gguf_weights
from novainfer.model_loader.weight_utils import iterate_weights
from novainfer.models.registry import ModelRegistry


class WeightLoadingError(ValueError):
    pass


def _map_name(model: nn.Module, name: str) -> tuple[str, int | str | None]:
    for ckpt_fragment, (param_fragment, shard_id) in getattr(model, "packed_modules_mapping", {}).items():
        if f".{ckpt_fragment}." in name:
            return name.replace(f".{ckpt_fragment}.", f".{param_fragment}."), shard_id
    return name, None


def _expected_checkpoint_names(model: nn.Module) -> set[str]:
    """Every checkpoint tensor name the model needs, fused parameters expanded to their parts."""
    packed = getattr(model, "packed_modules_mapping", {})
    expected = set()
    for name, _ in model.named_parameters():  # shared (tied) parameters appear once
        parts = [frag for frag, (param_frag, _) in packed.items() if f".{param_frag}." in name]
        for frag in parts:
            param_frag = packed[frag][0]
            expected.add(name.replace(f".{param_frag}.", f".{frag}."))
        if not parts:
            expected.add(name)
    return expected


def load_weights(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
    params = dict(model.named_parameters(remove_duplicate=False))
    tied = getattr(model, "tie_word_embeddings", False)
    ignored = getattr(model, "ignored_checkpoint_suffixes", ())
    expected = _expected_checkpoint_names(model)
    loaded: set[str] = set()
    unexpected: list[str] = []
    for name, tensor in weights:
        if name.endswith(ignored) or (tied and name == "lm_head.weight"):
            continue
        param_name, shard_id = _map_name(model, name)
        param = params.get(param_name)
        if param is None or name not in expected:
            unexpected.append(f"{name} {tuple(tensor.shape)}")
            continue
        if shard_id is not None:
            param.weight_loader(param, tensor, shard_id, weight_name=name)
        else:
            _load_plain(param, tensor, name)
        loaded.add(name)
    missing = sorted(expected - loaded)
    if unexpected or missing:
        problems = []
        if missing:
            problems.append(f"missing weights: {missing}")
        if unexpected:
            problems.append(f"unexpected weights (name, shape): {sorted(unexpected)}")
        raise WeightLoadingError("; ".join(problems))


def _load_plain(param: nn.Parameter, tensor: torch.Tensor, name: str) -> None:
    loader = getattr(param, "weight_loader", None)
    if loader is not None:
        loader(param, tensor, weight_name=name)
        return
    if tuple(tensor.shape) != tuple(param.shape):
        raise WeightLoadingError(f"weight {name!r} has shape {tuple(tensor.shape)}, expected {tuple(param.shape)}")
    param.data.copy_(tensor.to(param.dtype))


def build_model(hf_config, dtype: torch.dtype, device: torch.device, *,
                vocab_parallel: bool | None = None) -> nn.Module:
    """Instantiates the registered class for ``hf_config.architectures`` (parameters uninitialised).

    ``vocab_parallel=None`` leaves the choice to the enclosing ``tp_group_context``."""
    model_cls, _ = ModelRegistry.resolve(getattr(hf_config, "architectures", None))
    with torch.device(device):
        return model_cls(hf_config, dtype, vocab_parallel=vocab_parallel)


def load_model(model_path: str | Path, hf_config, dtype: torch.dtype, device: torch.device, *,
               vocab_parallel: bool | None = None) -> nn.Module:
    """Builds the model and loads a Hugging Face directory's safetensors or a GGUF file into it."""
    model = build_model(hf_config, dtype, device, vocab_parallel=vocab_parallel)
    weights = iterate_gguf_weights(model_path) if is_gguf_file(model_path) else iterate_weights(model_path)
    load_weights(model, weights)
    return model.eval()
