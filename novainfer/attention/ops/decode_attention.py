"""Paged decode attention: one query token per sequence, split-K over the context.

Grid ``(num_seqs, num_kv_heads, num_splits)``. A program loads every query head that reads its KV
head (grouped-query attention: each K/V tile is loaded once for the whole group) and attends to its
share of the sequence's context. The share is computed from ``seq_lens[b]`` at run time, so the
launch has no data-dependent shape and can be captured in a CUDA graph: ``num_splits`` is fixed by
the batch size and an upper bound on the context length, and splits past a short sequence's end do
no work (``num_splits`` is a run-time argument: a new value compiles nothing). With one split the
program writes the output directly; otherwise each split writes a normalised partial output and its
log-sum-exp, and :func:`_reduce_splits_kernel` combines them.

A sequence with ``seq_len == 0`` (padding in a CUDA-graph batch) yields a zero output row.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from novainfer.attention.ops.common import (check_kv_cache, check_out, dot_precision, head_pad, queries_per_kv,
                                           scale_log2, unit_last_stride)
from novainfer.attention.ops.paged_tile import attend_paged_tile
from novainfer.layers.ops.common import cdiv, next_power_of_2
from novainfer.layers.ops.launcher import KernelLauncher

MAX_SPLITS = 64
# Programs per SM the split count aims for: on an H200 (132 SMs) about 512 programs in all was
# fastest from batch 1 to 256 (benchmarks/attention_kernels.py --sweep decode).
PROGRAMS_PER_SM = 4


@dataclass(frozen=True)
class DecodeTileConfig:
    block_n: int  # keys per tile
    num_warps: int
    num_stages: int


def decode_tile_config(head_size: int) -> DecodeTileConfig:
    """The fastest tiles measured on an H200 for head sizes 64 and 128 (a 128-key tile with 3 stages
    of prefetch); larger heads halve the tile to fit shared memory."""
    return DecodeTileConfig(128, 4, 3) if head_size <= 128 else DecodeTileConfig(64, 4, 2)


def choose_num_splits(num_seqs: int, num_kv_heads: int, head_size: int, max_seq_len: int, num_sms: int) -> int:
    """About PROGRAMS_PER_SM programs per SM in all, and no split shorter than one key tile.

    ``max_seq_len`` may be an upper bound (a CUDA-graph batch): then short sequences simply leave
    their trailing splits empty.
    """
    programs = max(1, num_seqs * num_kv_heads)
    wanted = PROGRAMS_PER_SM * num_sms // programs
    longest_useful = cdiv(max(max_seq_len, 1), decode_tile_config(head_size).block_n)
    return max(1, min(wanted, longest_useful, MAX_SPLITS))


# Not specialized on the block table's row stride: it follows the step buffers' capacity, and start-up
# compiles each variant once with a table of its own (see TritonAttentionBackend.warm_up).
@triton.jit(do_not_specialize=["scale_log2", "num_splits", "stride_block_table"])
def _decode_attention_kernel(
        q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, part_out_ptr, part_lse_ptr, block_tables_ptr, seq_lens_ptr,
        query_start_loc_ptr, scale_log2, num_splits, stride_q_t, stride_q_h, stride_out_t, stride_out_h,
        stride_cache_block, stride_cache_slot, stride_cache_head, stride_block_table,
        NUM_HEADS: tl.constexpr, QUERIES_PER_KV: tl.constexpr, GROUP_PAD: tl.constexpr,
        BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_SIZE: tl.constexpr, HEAD_PAD: tl.constexpr,
        SPLIT_K: tl.constexpr, DECODE_ONLY: tl.constexpr, DOT_PRECISION: tl.constexpr):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    if DECODE_ONLY:
        is_decode = True
        token = seq.to(tl.int64)
        seq_len = tl.load(seq_lens_ptr + seq)
    else:
        # A mixed step: sequences with more than one query belong to the prefill kernel. They attend
        # to nothing here and their stores are masked off. (An early return instead made the compiler
        # keep 168 registers rather than 128, and the kernel 25% slower, on an H200.)
        start_row = tl.load(query_start_loc_ptr + seq)
        is_decode = tl.load(query_start_loc_ptr + seq + 1) - start_row == 1
        seq_len = tl.where(is_decode, tl.load(seq_lens_ptr + seq), 0)
        token = tl.where(is_decode, start_row, 0).to(tl.int64)
    tokens_per_split = tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N
    start = split * tokens_per_split
    end = tl.minimum(start + tokens_per_split, seq_len)
    full_end = start + tl.maximum(end - start, 0) // BLOCK_N * BLOCK_N

    group = tl.arange(0, GROUP_PAD)
    dim = tl.arange(0, HEAD_PAD)
    head = kv_head * QUERIES_PER_KV + group
    row_mask = (group < QUERIES_PER_KV)[:, None] & (dim < HEAD_SIZE)[None, :]
    q = tl.load(q_ptr + token * stride_q_t + head[:, None] * stride_q_h + dim[None, :], mask=row_mask, other=0.0)

    acc = tl.zeros([GROUP_PAD, HEAD_PAD], dtype=tl.float32)
    l_i = tl.zeros([GROUP_PAD], dtype=tl.float32)
    m_i = tl.full([GROUP_PAD], float("-inf"), dtype=tl.float32)
    block_table_ptr = block_tables_ptr + seq.to(tl.int64) * stride_block_table
    kv_head_offset = kv_head * stride_cache_head
    for tile_start in range(start, full_end, BLOCK_N):
        acc, l_i, m_i = attend_paged_tile(
            q, acc, l_i, m_i, k_cache_ptr, v_cache_ptr, block_table_ptr, kv_head_offset, tile_start, end, None,
            stride_cache_block, stride_cache_slot, scale_log2, BLOCK_SIZE, BLOCK_N, HEAD_SIZE, HEAD_PAD,
            False, False, DOT_PRECISION)
    if full_end < end:
        acc, l_i, m_i = attend_paged_tile(
            q, acc, l_i, m_i, k_cache_ptr, v_cache_ptr, block_table_ptr, kv_head_offset, full_end, end, None,
            stride_cache_block, stride_cache_slot, scale_log2, BLOCK_SIZE, BLOCK_N, HEAD_SIZE, HEAD_PAD,
            True, False, DOT_PRECISION)

    # An empty range (padding row, or a split past the end) leaves l = 0: write zeros, lse = -inf.
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    if not SPLIT_K:
        tl.store(out_ptr + token * stride_out_t + head[:, None] * stride_out_h + dim[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=row_mask & is_decode)
    else:
        part = (seq.to(tl.int64) * NUM_HEADS + head) * num_splits + split
        tl.store(part_out_ptr + part[:, None] * HEAD_PAD + dim[None, :], out, mask=row_mask & is_decode)
        lse = tl.where(l_i > 0, m_i + tl.log2(l_i), float("-inf"))
        tl.store(part_lse_ptr + part, lse, mask=(group < QUERIES_PER_KV) & is_decode)


_launch_decode_attention = KernelLauncher(_decode_attention_kernel)


@triton.jit(do_not_specialize=["num_splits"])
def _reduce_splits_kernel(out_ptr, part_out_ptr, part_lse_ptr, query_start_loc_ptr, num_splits, stride_out_t,
                          stride_out_h, NUM_HEADS: tl.constexpr, HEAD_SIZE: tl.constexpr, HEAD_PAD: tl.constexpr,
                          SPLITS_PAD: tl.constexpr, DECODE_ONLY: tl.constexpr):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    if DECODE_ONLY:
        token = seq.to(tl.int64)
    else:
        token = tl.load(query_start_loc_ptr + seq).to(tl.int64)
        if tl.load(query_start_loc_ptr + seq + 1) - token != 1:
            return
    split = tl.arange(0, SPLITS_PAD)
    dim = tl.arange(0, HEAD_PAD)
    part = (seq.to(tl.int64) * NUM_HEADS + head) * num_splits + split
    lse = tl.load(part_lse_ptr + part, mask=split < num_splits, other=float("-inf"))
    lse_max = tl.max(lse, 0)
    weights = tl.exp2(lse - tl.where(lse_max > float("-inf"), lse_max, 0.0))
    parts = tl.load(part_out_ptr + part[:, None] * HEAD_PAD + dim[None, :],
                    mask=(split < num_splits)[:, None] & (dim < HEAD_SIZE)[None, :], other=0.0)
    total = tl.sum(weights, 0)
    out = tl.sum(parts * weights[:, None], 0) / tl.where(total > 0, total, 1.0)
    tl.store(out_ptr + token * stride_out_t + head * stride_out_h + dim, out.to(out_ptr.dtype.element_ty),
             mask=dim < HEAD_SIZE)


_launch_reduce_splits = KernelLauncher(_reduce_splits_kernel)


def decode_workspace_shape(num_seqs: int, num_heads: int, head_size: int, num_splits: int):
    """Shapes of the float32 partial outputs and log-sum-exps that ``num_splits > 1`` needs."""
    return (num_seqs, num_heads, num_splits, head_pad(head_size)), (num_seqs, num_heads, num_splits)


def decode_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, out: torch.Tensor,
                     seq_lens: torch.Tensor, block_tables: torch.Tensor, scale: float, num_splits: int,
                     query_start_loc: torch.Tensor | None = None,
                     workspace: tuple[torch.Tensor, torch.Tensor] | None = None,
                     config: DecodeTileConfig | None = None, traced: bool = False) -> None:
    """Attention of one query token per sequence over its paged context, written into ``out``.

    ``query``/``out`` are [T, Hq, D]. Without ``query_start_loc`` every sequence ``b`` owns token row
    ``b`` (a decode-only step, T == num_seqs). With it, only sequences whose query length is 1 are
    computed (their row is ``query_start_loc[b]``); the others are left to the prefill kernel.
    ``workspace`` (see :func:`decode_workspace_shape`) is allocated here when needed and not given;
    ``config`` defaults to :func:`decode_tile_config`. ``traced``: launched for inductor to trace
    (see :meth:`KernelLauncher.traced`); then ``num_splits`` may be symbolic, so the reduction is
    compiled for MAX_SPLITS whatever the count.
    """
    num_seqs = seq_lens.shape[0]
    num_heads, head_size = query.shape[1], query.shape[2]
    num_kv_heads = k_cache.shape[2]
    check_kv_cache(k_cache, v_cache, num_kv_heads, head_size)
    check_out(out, query)
    if num_splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {num_splits}")
    if num_seqs == 0:
        return
    query = unit_last_stride(query)
    decode_only = query_start_loc is None
    if num_splits > 1 and workspace is None:
        out_shape, lse_shape = decode_workspace_shape(num_seqs, num_heads, head_size, num_splits)
        workspace = (torch.empty(out_shape, dtype=torch.float32, device=query.device),
                     torch.empty(lse_shape, dtype=torch.float32, device=query.device))
    part_out, part_lse = workspace if num_splits > 1 else (out, out)  # unused with one split
    group = queries_per_kv(num_heads, num_kv_heads)
    qsl = seq_lens if decode_only else query_start_loc  # unused in a decode-only launch
    config = config or decode_tile_config(head_size)
    _launch_decode_attention.traced(traced)[(num_seqs, num_kv_heads, num_splits)](
        query, k_cache, v_cache, out, part_out, part_lse, block_tables, seq_lens, qsl, scale_log2(scale),
        num_splits, query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        NUM_HEADS=num_heads, QUERIES_PER_KV=group, GROUP_PAD=max(16, next_power_of_2(group)),
        BLOCK_SIZE=k_cache.shape[1], BLOCK_N=config.block_n, HEAD_SIZE=head_size, HEAD_PAD=head_pad(head_size),
        SPLIT_K=num_splits > 1, DECODE_ONLY=decode_only, DOT_PRECISION=dot_precision(query.dtype),
        num_warps=config.num_warps, num_stages=config.num_stages)
    if num_splits > 1:
        _launch_reduce_splits.traced(traced)[(num_seqs, num_heads)](
            out, part_out, part_lse, qsl, num_splits, out.stride(0), out.stride(1),
            NUM_HEADS=num_heads, HEAD_SIZE=head_size, HEAD_PAD=head_pad(head_size),
            SPLITS_PAD=MAX_SPLITS if traced else next_power_of_2(num_splits), DECODE_ONLY=decode_only,
            num_warps=1)
