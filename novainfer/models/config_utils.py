"""Reading model hyper-parameters that Hugging Face configs spell differently across versions."""

from __future__ import annotations


def get_head_dim(config) -> int:
    head_dim = getattr(config, "head_dim", None)
    return int(head_dim) if head_dim else config.hidden_size // config.num_attention_heads


def get_rope_theta(config) -> float:
    """``rope_theta`` from the config (older transformers) or its ``rope_parameters`` (newer)."""
    params = getattr(config, "rope_parameters", None) or {}
    scaling = getattr(config, "rope_scaling", None) or {}
    rope_type = params.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
    if rope_type != "default":
        raise NotImplementedError(f"rope type {rope_type!r} is not supported (only 'default')")
    theta = params.get("rope_theta", getattr(config, "rope_theta", None))
    if theta is None:
        raise ValueError("the model config has no rope_theta")
    return float(theta)
