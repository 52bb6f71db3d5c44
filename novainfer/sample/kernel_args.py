"""Arguments of the sampler's Triton kernels."""

from __future__ import annotations

import torch

_STAND_INS: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}


def stand_in(tensor: torch.Tensor | None, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``tensor`` (contiguous), or a one-element [1, 1] tensor of ``dtype`` in its place, for an input
    or output a kernel's runtime flag leaves untouched: the signature, and so the compiled variant,
    stays that of the present tensor. Made once per dtype and device (a step would otherwise
    allocate and fill several)."""
    if tensor is not None:
        return tensor.contiguous()
    stand_in_tensor = _STAND_INS.get((dtype, device))
    if stand_in_tensor is None:
        stand_in_tensor = _STAND_INS[(dtype, device)] = torch.zeros(1, 1, dtype=dtype, device=device)
    return stand_in_tensor
