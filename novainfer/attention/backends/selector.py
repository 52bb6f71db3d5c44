"""Picks the attention backend for a device (Triton on CUDA, PyTorch's fused attention elsewhere)."""

from __future__ import annotations

import importlib.util

import torch

from novainfer.attention.backends.abstract import AttentionBackend
from novainfer.attention.backends.torch_ref import TorchReferenceBackend, TorchSDPABackend

# torch: the reference (einsum, the oracle); sdpa: the same with scaled_dot_product_attention.
BACKEND_NAMES = ("torch", "sdpa", "triton")


def _triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def get_attn_backend(device: torch.device, name: str | None = None) -> AttentionBackend:
    """A new backend instance: ``name`` if given (one of BACKEND_NAMES), else the fastest for ``device``."""
    device = torch.device(device)
    if name is None:
        name = "triton" if device.type == "cuda" and _triton_available() else "sdpa"
    if name == "torch":
        return TorchReferenceBackend()
    if name == "sdpa":
        return TorchSDPABackend()
    if name == "triton":
        if device.type != "cuda":
            raise ValueError(f"attention backend 'triton' needs a CUDA device, got device {device}")
        if not _triton_available():
            raise ValueError("attention backend 'triton' needs the triton package, which is not installed")
        from novainfer.attention.backends.triton_attn import TritonAttentionBackend

        return TritonAttentionBackend()
    raise ValueError(f"unknown attention backend {name!r}; allowed values: {', '.join(BACKEND_NAMES)}")
