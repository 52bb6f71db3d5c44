"""Rotary position embedding ("rotate half" layout) applied to query and key heads in place."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rotate_heads(x_ptr, stride_t, stride_h, token, num_heads, cos, sin, HALF: tl.constexpr,
                  HALF_PAD: tl.constexpr, HEADS_PAD: tl.constexpr):
    head = tl.arange(0, HEADS_PAD)[:, None]
    i = tl.arange(0, HALF_PAD)[None, :]
    mask = (head < num_heads) & (i < HALF)
    first = x_ptr + token * stride_t + head * stride_h + i
    x1 = tl.load(first, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(first + HALF, mask=mask, other=0.0).to(tl.float32)
    tl.store(first, (x1 * cos - x2 * sin).to(x_ptr.dtype.element_ty), mask=mask)
    tl.store(first + HALF, (x2 * cos + x1 * sin).to(x_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rotary_embedding_kernel(positions_ptr, q_ptr, k_ptr, cos_ptr, sin_ptr, stride_q_t, stride_q_h, stride_k_t,
                             stride_k_h, stride_cos, num_q_heads, num_k_heads, HALF: tl.constexpr,
                             HALF_PAD: tl.constexpr, Q_HEADS_PAD: tl.constexpr, K_HEADS_PAD: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions_ptr + token).to(tl.int64)
    i = tl.arange(0, HALF_PAD)[None, :]
    # Both halves of a cached row hold the same angles: read the first half only.
    cos = tl.load(cos_ptr + pos * stride_cos + i, mask=i < HALF, other=0.0)
    sin = tl.load(sin_ptr + pos * stride_cos + i, mask=i < HALF, other=0.0)
    _rotate_heads(q_ptr, stride_q_t, stride_q_h, token, num_q_heads, cos, sin, HALF, HALF_PAD, Q_HEADS_PAD)
    _rotate_heads(k_ptr, stride_k_t, stride_k_h, token, num_k_heads, cos, sin, HALF, HALF_PAD, K_HEADS_PAD)


def rotary_embedding_(positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor, cos_cached: torch.Tensor,
                      sin_cached: torch.Tensor) -> None:
    """Rotates ``query`` [T, Hq, D] and ``key`` [T, Hkv, D] in place by ``positions`` [T].

    ``cos_cached``/``sin_cached`` are float32 [max_position, D] with both halves equal; the rotation
    is computed in float32 and rounded once. Heads may be strided (views into a fused QKV output)
    but each head's D elements must be contiguous.
    """
    num_tokens, num_q_heads, head_size = query.shape
    if query.stride(-1) != 1 or key.stride(-1) != 1:
        raise ValueError(f"in-place RoPE needs a contiguous head dim, got query strides {query.stride()} and "
                         f"key strides {key.stride()}")
    if num_tokens == 0:
        return
    half = head_size // 2
    _rotary_embedding_kernel[(num_tokens,)](
        positions, query, key, cos_cached, sin_cached, query.stride(0), query.stride(1), key.stride(0),
        key.stride(1), cos_cached.stride(0), num_q_heads, key.shape[1], HALF=half,
        HALF_PAD=triton.next_power_of_2(half), Q_HEADS_PAD=triton.next_power_of_2(num_q_heads),
        K_HEADS_PAD=triton.next_power_of_2(key.shape[1]), num_warps=1 if num_q_heads * half <= 512 else 4)
