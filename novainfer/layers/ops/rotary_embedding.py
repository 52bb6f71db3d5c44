"""Rotary position embedding ("rotate half" layout) applied to query and key heads in place.

The two ``@triton.jit`` helpers are also the rotation of the fused RoPE + KV-cache write
(:mod:`novainfer.attention.ops.reshape_and_cache`), so that both round exactly alike.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from novainfer.layers.ops.common import next_power_of_2
from novainfer.layers.ops.launcher import KernelLauncher


@triton.jit
def rope_angles(positions_ptr, cos_ptr, sin_ptr, token, stride_cos, HALF: tl.constexpr, HALF_PAD: tl.constexpr):
    """cos and sin [1, HALF_PAD] (float32) of ``token``'s position."""
    pos = tl.load(positions_ptr + token).to(tl.int64)
    i = tl.arange(0, HALF_PAD)[None, :]
    # Both halves of a cached row hold the same angles: read the first half only.
    cos = tl.load(cos_ptr + pos * stride_cos + i, mask=i < HALF, other=0.0)
    sin = tl.load(sin_ptr + pos * stride_cos + i, mask=i < HALF, other=0.0)
    return cos, sin


@triton.jit
def rotate_heads(src_ptr, dst_ptr, stride_src_h, stride_dst_h, num_heads, cos, sin, HALF: tl.constexpr,
                 HALF_PAD: tl.constexpr, HEADS_PAD: tl.constexpr):
    """Rotates ``num_heads`` heads of one token row at ``src_ptr`` (in float32) and stores them at
    ``dst_ptr`` (``src_ptr`` itself for an in-place rotation), rounded once to the source dtype and
    then to the destination's, as a rotation followed by a copy would."""
    head = tl.arange(0, HEADS_PAD)[:, None]
    i = tl.arange(0, HALF_PAD)[None, :]
    mask = (head < num_heads) & (i < HALF)
    src = src_ptr + head * stride_src_h + i
    dst = dst_ptr + head * stride_dst_h + i
    x1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF, mask=mask, other=0.0).to(tl.float32)
    dtype = src_ptr.dtype.element_ty
    tl.store(dst, (x1 * cos - x2 * sin).to(dtype).to(dst_ptr.dtype.element_ty), mask=mask)
    tl.store(dst + HALF, (x2 * cos + x1 * sin).to(dtype).to(dst_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rotary_embedding_kernel(positions_ptr, q_ptr, k_ptr, cos_ptr, sin_ptr, stride_q_t, stride_q_h, stride_k_t,
                             stride_k_h, stride_cos, num_q_heads, num_k_heads, HALF: tl.constexpr,
                             HALF_PAD: tl.constexpr, Q_HEADS_PAD: tl.constexpr, K_HEADS_PAD: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    cos, sin = rope_angles(positions_ptr, cos_ptr, sin_ptr, token, stride_cos, HALF, HALF_PAD)
    q_row = q_ptr + token * stride_q_t
    rotate_heads(q_row, q_row, stride_q_h, stride_q_h, num_q_heads, cos, sin, HALF, HALF_PAD, Q_HEADS_PAD)
    k_row = k_ptr + token * stride_k_t
    rotate_heads(k_row, k_row, stride_k_h, stride_k_h, num_k_heads, cos, sin, HALF, HALF_PAD, K_HEADS_PAD)


_launch_rotary_embedding = KernelLauncher(_rotary_embedding_kernel)


def check_rope_operands(query: torch.Tensor, key: torch.Tensor) -> None:
    """The kernels address heads through strides but need each head's elements contiguous."""
    if query.stride(-1) != 1 or key.stride(-1) != 1:
        raise ValueError(f"in-place RoPE needs a contiguous head dim, got query strides {query.stride()} and "
                         f"key strides {key.stride()}")


def rotary_embedding_(positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor, cos_cached: torch.Tensor,
                      sin_cached: torch.Tensor) -> None:
    """Rotates ``query`` [T, Hq, D] and ``key`` [T, Hkv, D] in place by ``positions`` [T].

    ``cos_cached``/``sin_cached`` are float32 [max_position, D] with both halves equal; the rotation
    is computed in float32 and rounded once. Heads may be strided (views into a fused QKV output)
    but each head's D elements must be contiguous.
    """
    num_tokens, num_q_heads, head_size = query.shape
    check_rope_operands(query, key)
    if num_tokens == 0:
        return
    half = head_size // 2
    _launch_rotary_embedding[(num_tokens,)](
        positions, query, key, cos_cached, sin_cached, query.stride(0), query.stride(1), key.stride(0),
        key.stride(1), cos_cached.stride(0), num_q_heads, key.shape[1], HALF=half,
        HALF_PAD=next_power_of_2(half), Q_HEADS_PAD=next_power_of_2(num_q_heads),
        K_HEADS_PAD=next_power_of_2(key.shape[1]), num_warps=1 if num_q_heads * half <= 512 else 4)
