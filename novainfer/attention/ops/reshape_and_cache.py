"""Writes a step's new key/value rows into the paged KV cache, optionally rotating them first (RoPE).

One kernel does both: with RoPE it rotates the query heads (in place, or into another tensor) and
stores the rotated keys (the attention kernels read keys from the cache only, so ``key`` itself is
left unrotated), which saves a launch and a pass over the keys per layer against a rotation followed
by the store.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from novainfer.attention.ops.common import check_kv_cache, unit_last_stride
from novainfer.layers.ops.common import next_power_of_2
from novainfer.layers.ops.launcher import KernelLauncher
from novainfer.layers.ops.rotary_embedding import check_rope_operands, rope_angles, rotate_heads


@triton.jit
def _reshape_and_cache_kernel(key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr, query_ptr,
                              query_out_ptr, positions_ptr, cos_ptr, sin_ptr, stride_key_t, stride_key_h,
                              stride_value_t, stride_value_h, stride_query_t, stride_query_h, stride_query_out_t,
                              stride_query_out_h, stride_cos, stride_cache_block,
                              stride_cache_slot, stride_cache_head, num_kv_heads, num_q_heads,
                              BLOCK_SIZE: tl.constexpr, HEAD_SIZE: tl.constexpr, HEADS_PAD: tl.constexpr,
                              HEAD_PAD: tl.constexpr, ROPE: tl.constexpr, Q_HEADS_PAD: tl.constexpr,
                              HALF_PAD: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    # A negative slot: a padding row of a CUDA-graph batch, none of whose heads is stored.
    stored_heads = tl.where(slot >= 0, num_kv_heads, 0)
    slot = tl.maximum(slot, 0)
    cache_row = (slot // BLOCK_SIZE) * stride_cache_block + (slot % BLOCK_SIZE) * stride_cache_slot
    head = tl.arange(0, HEADS_PAD)[:, None]
    dim = tl.arange(0, HEAD_PAD)[None, :]
    mask = (head < stored_heads) & (dim < HEAD_SIZE)
    if ROPE:
        cos, sin = rope_angles(positions_ptr, cos_ptr, sin_ptr, token, stride_cos, HEAD_SIZE // 2, HALF_PAD)
        rotate_heads(query_ptr + token * stride_query_t, query_out_ptr + token * stride_query_out_t, stride_query_h,
                     stride_query_out_h, num_q_heads, cos, sin, HEAD_SIZE // 2, HALF_PAD, Q_HEADS_PAD)
        rotate_heads(key_ptr + token * stride_key_t, k_cache_ptr + cache_row, stride_key_h, stride_cache_head,
                     stored_heads, cos, sin, HEAD_SIZE // 2, HALF_PAD, HEADS_PAD)
    else:
        k = tl.load(key_ptr + token * stride_key_t + head * stride_key_h + dim, mask=mask)
        tl.store(k_cache_ptr + cache_row + head * stride_cache_head + dim, k.to(k_cache_ptr.dtype.element_ty),
                 mask=mask)
    v = tl.load(value_ptr + token * stride_value_t + head * stride_value_h + dim, mask=mask)
    tl.store(v_cache_ptr + cache_row + head * stride_cache_head + dim, v.to(v_cache_ptr.dtype.element_ty),
             mask=mask)


_launch_reshape_and_cache = KernelLauncher(_reshape_and_cache_kernel)


def _store_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
              slot_mapping: torch.Tensor, query: torch.Tensor | None, query_out: torch.Tensor | None,
              positions: torch.Tensor | None, cos_cached: torch.Tensor | None, sin_cached: torch.Tensor | None,
              traced: bool) -> None:
    num_tokens, num_kv_heads, head_size = key.shape
    check_kv_cache(k_cache, v_cache, num_kv_heads, head_size)
    if num_tokens == 0:
        return
    key, value = unit_last_stride(key), unit_last_stride(value)
    rope = query is not None
    num_q_heads = query.shape[1] if rope else 0
    _launch_reshape_and_cache.traced(traced)[(num_tokens,)](
        key, value, k_cache, v_cache, slot_mapping, query, query_out, positions, cos_cached, sin_cached,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1), query.stride(0) if rope else 0,
        query.stride(1) if rope else 0, query_out.stride(0) if rope else 0, query_out.stride(1) if rope else 0,
        cos_cached.stride(0) if rope else 0,
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), num_kv_heads, num_q_heads,
        BLOCK_SIZE=k_cache.shape[1], HEAD_SIZE=head_size, HEADS_PAD=next_power_of_2(num_kv_heads),
        HEAD_PAD=next_power_of_2(head_size), ROPE=rope,
        Q_HEADS_PAD=next_power_of_2(num_q_heads) if rope else 1,
        HALF_PAD=next_power_of_2(head_size // 2),
        # As tuned for each op alone: the rotation of the query heads is the larger part of a RoPE store.
        num_warps=1 if (num_q_heads * head_size // 2 <= 512 if rope else num_kv_heads * head_size <= 256) else 4)


def reshape_and_cache(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      slot_mapping: torch.Tensor, traced: bool = False) -> None:
    """Stores ``key``/``value`` [T, Hkv, D] at cache slots ``slot_mapping`` [T] (``block * block_size +
    offset``); rows whose slot is negative are skipped. ``traced``: launched for inductor to trace
    (see :meth:`KernelLauncher.traced`)."""
    _store_kv(key, value, k_cache, v_cache, slot_mapping, None, None, None, None, None, traced)


def rotary_embedding_and_cache(positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                               k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                               cos_cached: torch.Tensor, sin_cached: torch.Tensor, traced: bool = False,
                               query_out: torch.Tensor | None = None) -> None:
    """RoPE and the KV-cache store in one pass: ``query`` [T, Hq, D] is rotated by ``positions`` [T]
    into ``query_out`` (same shape; ``query`` itself, in place, when not given), and ``key`` rotated,
    with ``value``, is stored as :func:`reshape_and_cache` stores them (``key`` itself is left as it
    is). Rounds exactly as :func:`~novainfer.layers.ops.rotary_embedding_` followed by
    :func:`reshape_and_cache` does. ``cos_cached``/``sin_cached``: float32 [max_position, D] with both
    halves equal."""
    check_rope_operands(query, key)
    if query.shape[0] != key.shape[0] or query.shape[2] != key.shape[2]:
        raise ValueError(f"query {tuple(query.shape)} and key {tuple(key.shape)} must have the same number of "
                         f"tokens and head size")
    if query_out is None:
        query_out = query
    elif query_out.shape != query.shape or query_out.dtype != query.dtype or query_out.stride(-1) != 1:
        raise ValueError(f"query_out {query_out.dtype}{tuple(query_out.shape)} must have query's shape and dtype "
                         f"({query.dtype}{tuple(query.shape)}) and unit stride in its last dimension")
    _store_kv(key, value, k_cache, v_cache, slot_mapping, query, query_out, positions, cos_cached, sin_cached, traced)
