"""SiLU-and-mul: ``silu(x[..., :d]) * x[..., d:]`` in one pass."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from novainfer.layers.ops.common import cdiv, next_power_of_2
from novainfer.layers.ops.launcher import KernelLauncher


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, stride_x, stride_out, d, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < d
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + d + cols, mask=mask, other=0.0)
    # Round silu(gate) to the activation dtype before the product, as the unfused ops do.
    act = (gate / (1.0 + tl.exp(-gate))).to(x_ptr.dtype.element_ty)
    out = act.to(tl.float32) * up.to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


_launch_silu_and_mul = KernelLauncher(_silu_and_mul_kernel)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``x`` [..., 2d] with a contiguous last dim -> [..., d]."""
    d = x.shape[-1] // 2
    x2d = x if x.dim() == 2 else x.reshape(-1, 2 * d)  # no view op for the model's [T, 2d] activations
    if x2d.stride(-1) != 1:
        x2d = x2d.contiguous()
    out = torch.empty(x2d.shape[0], d, dtype=x.dtype, device=x.device)
    if x2d.shape[0] and d:
        block = min(1024, next_power_of_2(d))
        _launch_silu_and_mul[(x2d.shape[0], cdiv(d, block))](
            x2d, out, x2d.stride(0), out.stride(0), d, BLOCK=block, num_warps=4 if block >= 512 else 1)
    return out if x.dim() == 2 else out.view(*x.shape[:-1], d)
