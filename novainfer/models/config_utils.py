"""Reading model hyper-parameters that Hugging Face configs spell differently across versions."""

from __future__ import annotations

from typing import Any

from novainfer.layers.rotary_embedding import RopeScaling


def get_head_dim(config) -> int:
    head_dim = getattr(config, "head_dim", None)
    return int(head_dim) if head_dim else config.hidden_size // config.num_attention_heads


def _rope_dict(config) -> dict[str, Any]:
    """RoPE settings in one dict: transformers 5 keeps them (``rope_theta`` included) in
    ``rope_parameters``; older versions have ``rope_theta`` and a ``rope_scaling`` dict (or None)."""
    merged: dict[str, Any] = {}
    for name in ("rope_scaling", "rope_parameters"):
        value = getattr(config, name, None)
        if isinstance(value, dict):
            merged.update(value)
    return merged


def get_rope_theta(config) -> float:
    theta = _rope_dict(config).get("rope_theta", getattr(config, "rope_theta", None))
    if theta is None:
        raise ValueError("the model config has no rope_theta")
    return float(theta)


def get_rope_scaling(config) -> RopeScaling:
    """The config's RoPE scaling (``rope_type`` or the older ``type`` key; none means "default").

    Raises NotImplementedError naming the type, and listing the supported ones, for any other scheme.
    """
    params = _rope_dict(config)
    rope_type = params.get("rope_type") or params.get("type") or "default"
    if rope_type == "default":
        return RopeScaling()
    fields = {"factor": float, "low_freq_factor": float, "high_freq_factor": float,
              "original_max_position_embeddings": int}
    kwargs = {name: cast(params[name]) for name, cast in fields.items() if params.get(name) is not None}
    if rope_type == "llama3":
        # As transformers does: without it, the pre-training length is the model's own.
        kwargs.setdefault("original_max_position_embeddings", getattr(config, "max_position_embeddings", None))
    if rope_type in ("linear", "llama3") and "factor" not in kwargs:
        raise ValueError(f"rope_scaling of type {rope_type!r} needs a 'factor'; got {params}")
    return RopeScaling(rope_type, **kwargs)
