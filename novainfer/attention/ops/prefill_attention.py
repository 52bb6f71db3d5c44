"""Varlen causal attention over a paged cache: prompt chunks on top of a cached prefix.

The new tokens' K/V must already be in the cache (store first, then attend), so the context of a
sequence is simply positions ``[0, seq_len)`` of its block table, whether it came from an earlier
chunk, a prefix-cache hit or this step.

Grid ``(num_q_blocks, num_kv_heads)``. A program owns ``BLOCK_Q`` consecutive query tokens of one
sequence times the ``QUERIES_PER_KV`` query heads that read its KV head: ``BLOCK_M = BLOCK_Q *
QUERIES_PER_KV`` rows (rounded up to a power of two; extra rows are masked), so each K/V tile is
loaded once for the whole head group. Programs find their sequence by a binary search over
``query_start_loc`` on the device: sequence ``b``'s blocks are numbered from
``query_start_loc[b] // BLOCK_Q + b``, which bounds the total by ``num_tokens // BLOCK_Q + num_seqs``
without knowing the lengths on the host; programs past a sequence's last block return at once.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from novainfer.attention.ops.common import (check_kv_cache, check_out, dot_precision, head_pad, num_sms,
                                           queries_per_kv, scale_log2, unit_last_stride)
from novainfer.attention.ops.paged_tile import attend_paged_tile
from novainfer.layers.ops.common import next_power_of_2
from novainfer.layers.ops.launcher import KernelLauncher


# Sequences whose first query blocks one load of the kernel's search for its sequence compares at once.
SEARCH_CHUNK = tl.constexpr(256)


# Not specialized on the block table's row stride (see the decode kernel).
@triton.jit(do_not_specialize=["num_seqs", "scale_log2", "stride_block_table"])
def _prefill_attention_kernel(
        q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, block_tables_ptr, seq_lens_ptr, query_start_loc_ptr, num_seqs,
        scale_log2, stride_q_t, stride_q_h, stride_out_t, stride_out_h, stride_cache_block, stride_cache_slot,
        stride_cache_head, stride_block_table,
        QUERIES_PER_KV: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_SIZE: tl.constexpr,
        BLOCK_N: tl.constexpr, HEAD_SIZE: tl.constexpr, HEAD_PAD: tl.constexpr, SKIP_DECODES: tl.constexpr,
        DOT_PRECISION: tl.constexpr):
    q_block = tl.program_id(0)
    kv_head = tl.program_id(1)
    # The program's sequence: the last b whose first query block query_start_loc[b] // BLOCK_Q + b is
    # <= q_block. First blocks increase with b, so b is the number of them <= q_block, less one: a count
    # over chunks of the table, whose loads do not wait for each other as a binary search's do (a mixed
    # step of 256 sequences reads one chunk where a search made 8 dependent loads). (Not a helper
    # function: when inductor traces this kernel, its analysis of what the kernel writes takes a store
    # whose address depends on a helper's result as a write to the helper's pointer arguments.)
    count = tl.full((), 0, tl.int32)
    for chunk_start in range(0, num_seqs, SEARCH_CHUNK):
        chunk_seq = chunk_start + tl.arange(0, SEARCH_CHUNK)
        in_range = chunk_seq < num_seqs
        first_block = tl.load(query_start_loc_ptr + chunk_seq, mask=in_range, other=0) // BLOCK_Q + chunk_seq
        count += tl.sum((in_range & (first_block <= q_block)).to(tl.int32), 0)
    seq = count - 1
    q_start = tl.load(query_start_loc_ptr + seq)
    query_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    first_token = (q_block - (q_start // BLOCK_Q + seq)) * BLOCK_Q  # within the sequence's queries
    if first_token >= query_len:
        return
    if SKIP_DECODES and query_len == 1:  # left to the split-K decode kernel
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    context_len = seq_len - query_len  # tokens before this step's first query

    row = tl.arange(0, BLOCK_M)
    dim = tl.arange(0, HEAD_PAD)
    token = first_token + row // QUERIES_PER_KV
    head = kv_head * QUERIES_PER_KV + row % QUERIES_PER_KV
    row_valid = (row < BLOCK_Q * QUERIES_PER_KV) & (token < query_len)
    io_mask = row_valid[:, None] & (dim < HEAD_SIZE)[None, :]
    token_row = (q_start + token).to(tl.int64)
    q = tl.load(q_ptr + token_row[:, None] * stride_q_t + head[:, None] * stride_q_h + dim[None, :],
                mask=io_mask, other=0.0)
    query_pos = context_len + token

    acc = tl.zeros([BLOCK_M, HEAD_PAD], dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    block_table_ptr = block_tables_ptr + seq.to(tl.int64) * stride_block_table
    kv_head_offset = kv_head * stride_cache_head
    first_pos = context_len + first_token
    kv_end = tl.minimum(first_pos + BLOCK_Q, seq_len)  # one past the last query's position
    # Keys up to first_pos are visible to every row: whole tiles of them need no mask.
    full_end = (first_pos + 1) // BLOCK_N * BLOCK_N
    for tile_start in range(0, full_end, BLOCK_N):
        acc, l_i, m_i = attend_paged_tile(
            q, acc, l_i, m_i, k_cache_ptr, v_cache_ptr, block_table_ptr, kv_head_offset, tile_start, kv_end,
            query_pos, stride_cache_block, stride_cache_slot, scale_log2, BLOCK_SIZE, BLOCK_N, HEAD_SIZE, HEAD_PAD,
            False, True, DOT_PRECISION)
    for tile_start in range(full_end, kv_end, BLOCK_N):
        acc, l_i, m_i = attend_paged_tile(
            q, acc, l_i, m_i, k_cache_ptr, v_cache_ptr, block_table_ptr, kv_head_offset, tile_start, kv_end,
            query_pos, stride_cache_block, stride_cache_slot, scale_log2, BLOCK_SIZE, BLOCK_N, HEAD_SIZE, HEAD_PAD,
            True, True, DOT_PRECISION)

    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(out_ptr + token_row[:, None] * stride_out_t + head[:, None] * stride_out_h + dim[None, :],
             out.to(out_ptr.dtype.element_ty), mask=io_mask)


_launch_prefill_attention = KernelLauncher(_prefill_attention_kernel)


@dataclass(frozen=True)
class PrefillTileConfig:
    block_m: int  # query rows (tokens x heads of one KV group) per program
    block_n: int  # keys per tile
    num_warps: int
    num_stages: int


# Programs per SM from which a step runs faster on the large tile (fewer, longer programs).
LARGE_TILE_PROGRAMS_PER_SM = 5


def prefill_tile_config(head_size: int, query_rows: int = 0, num_sms: int = 1) -> PrefillTileConfig:
    """Tiles measured on an H200 (benchmarks/attention_kernels.py, ``--sweep prefill``).

    Head size 64: 128 rows x 64 keys on 8 warps when ``query_rows`` (tokens x query heads) give the
    step at least LARGE_TILE_PROGRAMS_PER_SM such programs per SM (6 prompts of 1,024: 56 us against
    63; 32 of 512: 88 against 115); smaller steps take 64 x 128 on 4 warps, twice the programs (one
    4,096-token prompt: 129 us against 147; a 512-token chunk beside 255 decodes, as in a captured
    mixed step: 13.5 against 17.1). Head size 128: 64 x 64 on 4 warps, within 3% of the sweep's best
    on prompts and faster on long prompts, cached prefixes and mixed steps.
    """
    if head_size > 64:
        return PrefillTileConfig(64, 64, 4, 2)
    if query_rows >= LARGE_TILE_PROGRAMS_PER_SM * num_sms * 128:
        return PrefillTileConfig(128, 64, 8, 2)
    return PrefillTileConfig(64, 128, 4, 2)


def prefill_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, out: torch.Tensor,
                      query_start_loc: torch.Tensor, seq_lens: torch.Tensor, block_tables: torch.Tensor,
                      scale: float, skip_decodes: bool = False, config: PrefillTileConfig | None = None,
                      traced: bool = False) -> None:
    """Causal attention of every query row of ``query`` [T, Hq, D] over its sequence's paged context.

    Sequence ``b`` owns rows ``query_start_loc[b] : query_start_loc[b + 1]``, which are the last
    ``query_len`` of its ``seq_lens[b]`` positions. With ``skip_decodes`` the rows of sequences
    with a single query are not written (the decode kernel computes them). ``config`` defaults to
    :func:`prefill_tile_config` for the step's size. ``traced``: launched for inductor to trace (see
    :meth:`KernelLauncher.traced`).
    """
    num_tokens, num_heads, head_size = query.shape
    num_seqs = seq_lens.shape[0]
    num_kv_heads = k_cache.shape[2]
    check_kv_cache(k_cache, v_cache, num_kv_heads, head_size)
    check_out(out, query)
    if num_tokens == 0 or num_seqs == 0:
        return
    query = unit_last_stride(query)
    group = queries_per_kv(num_heads, num_kv_heads)
    config = config or prefill_tile_config(head_size, num_tokens * num_heads, num_sms(query.device))
    block_m = max(config.block_m, next_power_of_2(group))
    block_q = block_m // group
    grid = (num_tokens // block_q + num_seqs, num_kv_heads)
    _launch_prefill_attention.traced(traced)[grid](
        query, k_cache, v_cache, out, block_tables, seq_lens, query_start_loc, num_seqs, scale_log2(scale),
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        QUERIES_PER_KV=group, BLOCK_Q=block_q, BLOCK_M=block_m, BLOCK_SIZE=k_cache.shape[1],
        BLOCK_N=config.block_n, HEAD_SIZE=head_size, HEAD_PAD=head_pad(head_size), SKIP_DECODES=skip_decodes,
        DOT_PRECISION=dot_precision(query.dtype), num_warps=config.num_warps, num_stages=config.num_stages)
