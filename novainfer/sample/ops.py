"""The counter-based noise of :mod:`novainfer.sample.rng` as one Triton kernel (CUDA).

The torch version runs about twenty elementwise passes over a [rows, vocabulary] int64 tensor; this
kernel computes each value in registers and writes it once, so seeded rows cost what a draw from
torch's own generator costs. It does the same int64 arithmetic as the torch version (the same
bits; only ``log`` may differ in the last place).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from novainfer.sample import rng

# The hash's constants (see novainfer.sample.rng), as compile-time constants of the kernels.
_MASK32 = tl.constexpr(rng.MASK32)
_MUL = tl.constexpr(rng.HASH_MUL)
_GOLDEN = tl.constexpr(rng.GOLDEN)


@triton.jit
def _mix32(x):
    x = ((x >> 16) ^ x) * _MUL & _MASK32
    x = ((x >> 16) ^ x) * _MUL & _MASK32
    x = ((x >> 16) ^ x) * _MUL & _MASK32
    return (x >> 16) ^ x


@triton.jit
def _exponential_noise_kernel(keys_ptr, token_ids_ptr, out_ptr, width, stride_ids, stride_out, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < width
    key = tl.load(keys_ptr + row).to(tl.int64)
    ids = tl.load(token_ids_ptr + row * stride_ids + cols, mask=mask, other=0).to(tl.int64)
    bits = _mix32((key + ids * _GOLDEN) & _MASK32)
    uniform = ((bits >> 9).to(tl.float32) + 0.5) * (1.0 / 8388608.0)  # rng.uniform_from_bits
    tl.store(out_ptr + row * stride_out + cols, -tl.log(uniform), mask=mask)


def exponential_noise_triton(keys: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """As :func:`novainfer.sample.rng.exponential_noise`: ``keys`` [B], ``token_ids`` [B, W] or [W]."""
    token_ids = token_ids.contiguous()
    width = token_ids.shape[-1]
    out = torch.empty(keys.shape[0], width, dtype=torch.float32, device=keys.device)
    block = 1024
    _exponential_noise_kernel[(keys.shape[0], triton.cdiv(width, block))](
        keys.contiguous(), token_ids, out, width, token_ids.stride(0) if token_ids.dim() == 2 else 0, out.stride(0),
        BLOCK=block)
    return out
