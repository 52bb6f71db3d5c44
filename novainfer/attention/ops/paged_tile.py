"""The inner step every attention kernel here shares: attend a tile of queries to one tile of keys.

Keys and values are read straight from the paged cache ([num_blocks, block_size, num_kv_heads,
head_size]): each key position of the tile is looked up in the sequence's block table, so a tile may
span several cache blocks and the cache block size need not match the tile size.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def attend_paged_tile(q, acc, l_i, m_i, k_cache_ptr, v_cache_ptr, block_table_ptr, kv_head_offset, tile_start,
                      kv_end, query_pos, stride_cache_block, stride_cache_slot, scale_log2,
                      BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_SIZE: tl.constexpr,
                      HEAD_PAD: tl.constexpr, MASKED: tl.constexpr, CAUSAL: tl.constexpr,
                      DOT_PRECISION: tl.constexpr):
    """One online-softmax update of ``(acc, l_i, m_i)`` with keys ``[tile_start, tile_start + BLOCK_N)``.

    ``q`` is [M, HEAD_PAD]; scores are kept in the log2 domain (``scale_log2`` = scale * log2(e)).
    ``MASKED`` tiles drop keys at or past ``kv_end`` and, when ``CAUSAL``, keys after each row's
    ``query_pos``; unmasked tiles must lie wholly inside every row's visible range.
    """
    pos = tile_start + tl.arange(0, BLOCK_N)
    dim = tl.arange(0, HEAD_PAD)
    in_range = pos < kv_end
    block_ids = tl.load(block_table_ptr + pos // BLOCK_SIZE, mask=in_range, other=0)
    offsets = block_ids.to(tl.int64) * stride_cache_block + (pos % BLOCK_SIZE) * stride_cache_slot + kv_head_offset
    kv_mask = in_range[:, None] & (dim < HEAD_SIZE)[None, :]
    k = tl.load(k_cache_ptr + offsets[:, None] + dim[None, :], mask=kv_mask, other=0.0)
    # (Inductor passes a float argument as float64, or as a Python float when it analyses the kernel:
    # keep the scores float32.)
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * tl.cast(scale_log2, tl.float32)
    if MASKED:
        visible = in_range[None, :]
        if CAUSAL:
            visible = visible & (pos[None, :] <= query_pos[:, None])
        s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    # A row that has seen no visible key yet keeps m = -inf; exponentiate against 0 instead so
    # that it gets p = 0 and alpha = 0 rather than NaN.
    m_ref = tl.where(m_new > float("-inf"), m_new, 0.0)
    p = tl.exp2(s - m_ref[:, None])
    alpha = tl.exp2(m_i - m_ref)
    l_i = l_i * alpha + tl.sum(p, 1)
    v = tl.load(v_cache_ptr + offsets[:, None] + dim[None, :], mask=kv_mask, other=0.0)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return acc, l_i, m_new
