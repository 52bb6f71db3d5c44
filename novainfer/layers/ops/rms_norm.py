"""RMSNorm, optionally fused with the residual add before it: one pass over each row."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit(do_not_specialize=["eps"])
def _rms_norm_kernel(x_ptr, residual_ptr, weight_ptr, out_ptr, residual_out_ptr, stride_x, stride_residual,
                     stride_out, stride_residual_out, hidden_size, eps, HAS_RESIDUAL: tl.constexpr,
                     BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden_size
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        # The sum is rounded to the activation dtype first, as the unfused ``x + residual`` is.
        x = (x.to(tl.float32) + tl.load(residual_ptr + row * stride_residual + cols, mask=mask,
                                        other=0.0).to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(residual_out_ptr + row * stride_residual_out + cols, x, mask=mask)
    x32 = x.to(tl.float32)
    inv_rms = tl.rsqrt(tl.sum(x32 * x32, 0) / hidden_size + eps)
    normed = (x32 * inv_rms).to(x_ptr.dtype.element_ty)  # cast back before scaling, as the layer does
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0)
    out = weight.to(tl.float32) * normed.to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
    """``weight * norm(x)``; with ``residual``: ``(weight * norm(x + residual), x + residual)``.

    ``x`` and ``residual`` are [..., hidden] with a contiguous last dim; the output dtype is the
    promotion of ``weight`` and ``x`` (as for the unfused product).
    """
    hidden_size = x.shape[-1]
    x2d = x.reshape(-1, hidden_size)
    if x2d.stride(-1) != 1:
        x2d = x2d.contiguous()
    num_rows = x2d.shape[0]
    out = torch.empty(x2d.shape, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    residual_out = residual2d = None
    if residual is not None:
        residual2d = residual.reshape(-1, hidden_size)
        if residual2d.stride(-1) != 1:
            residual2d = residual2d.contiguous()
        residual_out = torch.empty_like(x2d)
    if num_rows:
        block = triton.next_power_of_2(hidden_size)
        _rms_norm_kernel[(num_rows,)](
            x2d, residual2d, weight, out, residual_out, x2d.stride(0),
            0 if residual2d is None else residual2d.stride(0), out.stride(0),
            0 if residual_out is None else residual_out.stride(0), hidden_size, eps,
            HAS_RESIDUAL=residual is not None, BLOCK=block, num_warps=min(16, max(1, block // 256)))
    out = out.view(x.shape)
    return out if residual is None else (out, residual_out.view(x.shape))
