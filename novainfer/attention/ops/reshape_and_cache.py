"""Writes a step's new key/value rows into the paged KV cache."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from novainfer.attention.ops.common import check_kv_cache, unit_last_stride


@triton.jit
def _reshape_and_cache_kernel(key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr,
                              stride_key_t, stride_key_h, stride_value_t, stride_value_h,
                              stride_cache_block, stride_cache_slot, stride_cache_head, num_kv_heads,
                              BLOCK_SIZE: tl.constexpr, HEAD_SIZE: tl.constexpr, HEADS_PAD: tl.constexpr,
                              HEAD_PAD: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:  # a padding row of a CUDA-graph batch: nothing to store
        return
    head = tl.arange(0, HEADS_PAD)[:, None]
    dim = tl.arange(0, HEAD_PAD)[None, :]
    mask = (head < num_kv_heads) & (dim < HEAD_SIZE)
    dst = (slot // BLOCK_SIZE) * stride_cache_block + (slot % BLOCK_SIZE) * stride_cache_slot \
        + head * stride_cache_head + dim
    k = tl.load(key_ptr + token * stride_key_t + head * stride_key_h + dim, mask=mask)
    tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    v = tl.load(value_ptr + token * stride_value_t + head * stride_value_h + dim, mask=mask)
    tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def reshape_and_cache(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      slot_mapping: torch.Tensor) -> None:
    """Stores ``key``/``value`` [T, Hkv, D] at cache slots ``slot_mapping`` [T] (``block * block_size +
    offset``); rows whose slot is negative are skipped."""
    num_tokens, num_kv_heads, head_size = key.shape
    check_kv_cache(k_cache, v_cache, num_kv_heads, head_size)
    if num_tokens == 0:
        return
    key, value = unit_last_stride(key), unit_last_stride(value)
    _reshape_and_cache_kernel[(num_tokens,)](
        key, value, k_cache, v_cache, slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), num_kv_heads,
        BLOCK_SIZE=k_cache.shape[1], HEAD_SIZE=head_size, HEADS_PAD=triton.next_power_of_2(num_kv_heads),
        HEAD_PAD=triton.next_power_of_2(head_size), num_warps=1 if num_kv_heads * head_size <= 256 else 4)
