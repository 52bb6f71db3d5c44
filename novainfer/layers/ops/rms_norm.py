"""RMSNorm, optionally fused with the residual add before it: one pass over each row."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from novainfer.layers.ops.common import next_power_of_2
from novainfer.layers.ops.launcher import KernelLauncher


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


_launch_rms_norm = KernelLauncher(_rms_norm_kernel)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
    """``weight * norm(x)``; with ``residual``: ``(weight * norm(x + residual), x + residual)``.

    ``x`` and ``residual`` are [..., hidden] with a contiguous last dim; the output dtype is the
    promotion of ``weight`` and ``x`` (as for the unfused product).
    """
    hidden_size = x.shape[-1]
    x2d = _rows(x, hidden_size)
    out_dtype = x.dtype if weight.dtype == x.dtype else torch.promote_types(weight.dtype, x.dtype)
    out = torch.empty(x2d.shape, dtype=out_dtype, device=x.device)
    residual_out = residual2d = None
    if residual is not None:
        residual2d = _rows(residual, hidden_size)
        residual_out = torch.empty(x2d.shape, dtype=x.dtype, device=x.device)
    _launch(x2d, residual2d, weight, out, residual_out, eps)
    if x.dim() != 2:  # the model's activations are [T, hidden] already: no view ops per layer for them
        out, residual_out = out.view(x.shape), None if residual_out is None else residual_out.view(x.shape)
    return out if residual is None else (out, residual_out)


def fused_add_rms_norm_(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                        eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`rms_norm` with ``residual`` written over its inputs: ``residual`` becomes ``x +
    residual`` and ``x`` becomes ``weight * norm(x + residual)``, the same values; returns ``(x,
    residual)``. No allocation: a decoder layer never reads either input again. ``x`` and
    ``residual`` are distinct [T, hidden] tensors with a contiguous last dim, of ``weight``'s dtype."""
    if x.dim() != 2 or residual.shape != x.shape or x.stride(-1) != 1 or residual.stride(-1) != 1:
        raise ValueError(f"in-place RMSNorm needs x and residual of one shape [T, hidden] with a contiguous last "
                         f"dim, got {tuple(x.shape)} strides {x.stride()} and {tuple(residual.shape)} strides "
                         f"{residual.stride()}")
    if weight.dtype != x.dtype or residual.dtype != x.dtype:
        raise ValueError(f"in-place RMSNorm needs one dtype, got x {x.dtype}, residual {residual.dtype} and "
                         f"weight {weight.dtype}")
    if x.data_ptr() == residual.data_ptr() and x.numel():
        raise ValueError("in-place RMSNorm needs x and residual in different memory")
    _launch(x, residual, weight, x, residual, eps)
    return x, residual


def _launch(x2d: torch.Tensor, residual2d: torch.Tensor | None, weight: torch.Tensor, out: torch.Tensor,
            residual_out: torch.Tensor | None, eps: float) -> None:
    """One program per row; each program reads its row before writing it, so outputs may be the inputs."""
    num_rows, hidden_size = x2d.shape
    if not num_rows:
        return
    block = next_power_of_2(hidden_size)
    _launch_rms_norm[(num_rows,)](
        x2d, residual2d, weight, out, residual_out, x2d.stride(0),
        0 if residual2d is None else residual2d.stride(0), out.stride(0),
        0 if residual_out is None else residual_out.stride(0), hidden_size, eps,
        HAS_RESIDUAL=residual2d is not None, BLOCK=block, num_warps=min(16, max(1, block // 256)))


def _rows(x: torch.Tensor, hidden_size: int) -> torch.Tensor:
    """``x`` as [rows, hidden] with a contiguous last dim (``x`` itself when it already is)."""
    x2d = x if x.dim() == 2 else x.reshape(-1, hidden_size)
    return x2d if x2d.stride(-1) == 1 else x2d.contiguous()
