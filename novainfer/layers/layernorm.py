"""RMSNorm, optionally fused with the residual add that precedes it in a decoder layer."""

from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6, *, params_dtype: torch.dtype | None = None,
                 prefix: str = "") -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=params_dtype or torch.get_default_dtype()),
                                   requires_grad=False)
        self.weight.weight_name = f"{prefix}.weight"

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in float32 and cast back before scaling, exactly as the reference
        # implementation does, so that low-precision runs round at the same places.
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)

    def forward_native(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """``norm(x)``; with ``residual``: ``(norm(x + residual), x + residual)``."""
        if residual is None:
            return self._norm(x)
        x = x + residual
        return self._norm(x), x

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """As :meth:`forward_native`; on CUDA one fused Triton kernel does the add and the norm (under
        torch.compile, inductor fuses the PyTorch code with its neighbours instead). There, with
        ``residual`` (a decoder layer's case), the results are written over ``x`` and ``residual``,
        which saves two allocations per call: callers do not read their inputs afterwards."""
        if x.is_cuda and not torch.compiler.is_compiling():
            from novainfer.layers.ops import fused_add_rms_norm_, rms_norm

            if residual is not None and x.dim() == 2 and self.weight.dtype == x.dtype:
                return fused_add_rms_norm_(x, residual, self.weight, self.eps)
            return rms_norm(x, self.weight, self.eps, residual)
        return self.forward_native(x, residual)
