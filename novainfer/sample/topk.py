"""Top-k of each row of [B, V] logits for small k (Triton, CUDA): the sampler's top-k candidates and
its logprobs' top alternatives, in place of ``torch.topk`` (a radix select of several passes).

Entries are compared as int64 keys: the float32 value's bits mapped to an order-preserving signed
integer in the high half, the complement of the token id in the low half. Keys are distinct, so the
k largest keys are well defined: the k largest values, and among equal values the lowest ids (the
order of a stable descending sort). -0.0 ranks below +0.0 and NaN above +inf (or, for a negative
NaN, below -inf): a stable sort compares them otherwise, but they are values that compare equal
or broken logits.

Two launches. The first cuts each row into chunks; a program keeps its chunk's k largest keys.
Rather than sorting the chunk, it splits it into ``GROUPS`` >= k strided groups and takes the k-th
largest of the group maxima as a threshold: k groups have a maximum at or above it, so at least k
keys are, and the chunk's k largest are among the keys at or above it, typically about 1.15 k of
the chunk's 4,096. Those candidates are compacted (a prefix sum gives each its slot) and only they
are sorted (a bitonic top-k, ``tl.topk``). Where more than ``CAP`` keys pass (only at most k groups
hold them, so a chunk whose largest values share few residues modulo ``GROUPS``), the whole chunk
is sorted instead: the same result, slower. For k up to 16 (logprobs, small top-k) the chunk keeps
each of 256 groups' two largest keys instead, which hold every candidate unless a group has three
(then the whole chunk is sorted). The second launch takes each row's k largest of its chunks' lists.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from novainfer.layers.ops.launcher import KernelLauncher
from novainfer.sample.kernel_args import stand_in

# Widths the kernels are compiled for (each k is served by the smallest that holds it), so that
# start-up compiles few variants. Larger k goes to torch.topk.
WIDTHS = (16, 64, 128)
MAX_K = WIDTHS[-1]

_MASK32 = tl.constexpr(0xFFFFFFFF)
_LOW31 = tl.constexpr(0x7FFFFFFF)
# Below every key of a real entry (whose low half, the complemented id, is never 0 with a high half
# at its minimum): the padding past the vocabulary.
_NONE = tl.constexpr(-(2**63))


@triton.jit
def ordered_key(x):
    """int32 keys of float32 ``x`` that order as the values: negative floats order backwards as
    integers, and flipping their magnitude bits fixes that."""
    bits = x.to(tl.int32, bitcast=True)
    return bits ^ ((bits >> 31) & _LOW31)


@triton.jit
def ordered_value(key):
    """The float32 value of an :func:`ordered_key` key (the mapping is its own inverse)."""
    return (key ^ ((key >> 31) & _LOW31)).to(tl.float32, bitcast=True)


@triton.jit
def _keys(values, ids):
    """int64 keys of float ``values`` (any float dtype) at token ``ids`` (int64, < 2**32)."""
    return (ordered_key(values.to(tl.float32)).to(tl.int64) << 32) | (_MASK32 - ids)


@triton.jit
def _unkey(keys):
    """(float32 values, int64 ids) of :func:`_keys`' keys."""
    return ordered_value((keys >> 32).to(tl.int32)), _MASK32 - (keys & _MASK32)


@triton.jit
def combined_lse(chunk_max_ptr, chunk_sum_ptr, row, num_chunks, CHUNKS: tl.constexpr):
    """A row's log-sum-exp from its chunks' maxima and sums of exp(logit - maximum)."""
    chunks = tl.arange(0, CHUNKS)
    valid = chunks < num_chunks
    maxima = tl.load(chunk_max_ptr + row * num_chunks + chunks, mask=valid, other=float("-inf"))
    sums = tl.load(chunk_sum_ptr + row * num_chunks + chunks, mask=valid, other=0.0)
    row_max = tl.max(maxima, axis=0)
    return row_max + tl.log(tl.sum(tl.where(maxima > float("-inf"), sums * tl.exp(maxima - row_max), 0.0), axis=0))


@triton.jit(do_not_specialize=["stride_logits", "vocab_size", "num_chunks", "use_sampled", "use_lse"])
def _top_k_chunks_kernel(logits_ptr, stride_logits, vocab_size, num_chunks, scratch_ptr, out_ptr,
                         use_sampled, sampled_ptr, sampled_logit_ptr, greater_ptr, use_lse, chunk_max_ptr,
                         chunk_sum_ptr,
                         BLOCK: tl.constexpr, K: tl.constexpr, GROUPS: tl.constexpr, CAP: tl.constexpr,
                         TWO_PER_GROUP: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    program = row * num_chunks + chunk
    ids = chunk.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    in_vocab = ids < vocab_size
    x = tl.load(logits_ptr + row * stride_logits + ids, mask=in_vocab, other=float("-inf")).to(tl.float32)
    if use_sampled != 0:
        # The sampled token's logit, and how many of the chunk's exceed it (its rank, summed).
        sampled_logit = tl.load(logits_ptr + row * stride_logits + tl.load(sampled_ptr + row)).to(tl.float32)
        tl.store(greater_ptr + program, tl.sum((x > sampled_logit).to(tl.int32), axis=0))
        if chunk == 0:
            tl.store(sampled_logit_ptr + row, sampled_logit)
    if use_lse != 0:
        chunk_max = tl.max(x, axis=0)
        tl.store(chunk_max_ptr + program, chunk_max)
        tl.store(chunk_sum_ptr + program, tl.sum(tl.where(x > float("-inf"), tl.exp(x - chunk_max), 0.0), axis=0))
    keys = tl.where(in_vocab, _keys(x, ids), _NONE)
    # Group g holds the entries g, g + GROUPS, ...: strided, so that runs of neighbouring ids with
    # large (or equal) values spread over many groups.
    grouped = tl.reshape(keys, [BLOCK // GROUPS, GROUPS])
    group_max = tl.max(grouped, axis=0)
    threshold = tl.min(tl.topk(group_max, K), axis=0)
    if TWO_PER_GROUP:
        # Where no group holds more than two keys at or above the threshold, the chunk's k largest
        # are among the groups' two largest: no compaction.
        rest = tl.where(grouped == group_max[None, :], _NONE, grouped)
        if tl.max(tl.sum((rest >= threshold).to(tl.int32), axis=0), axis=0) <= 1:
            top = tl.topk(tl.reshape(tl.join(group_max, tl.max(rest, axis=0)), [2 * GROUPS]), K)
        else:
            top = tl.topk(keys, K)
    else:
        top = _compacted_top_k(keys, threshold, scratch_ptr + program * CAP, K, CAP)
    tl.store(out_ptr + program * K + tl.arange(0, K), top)


_launch_top_k_chunks = KernelLauncher(_top_k_chunks_kernel)


@triton.jit
def _compacted_top_k(keys, threshold, scratch_ptr, K: tl.constexpr, CAP: tl.constexpr):
    """The ``K`` largest ``keys``, all at or above ``threshold``: the candidates are compacted into
    ``scratch_ptr``'s ``CAP`` slots and only they are sorted (all keys where more pass)."""
    candidate = keys >= threshold
    count = tl.sum(candidate.to(tl.int32), axis=0)
    if count <= CAP:
        slot = tl.cumsum(candidate.to(tl.int32), axis=0) - 1
        tl.store(scratch_ptr + slot, keys, mask=candidate)
        # The slots were written by other threads of the program.
        tl.debug_barrier()
        slots = tl.arange(0, CAP)
        top = tl.topk(tl.load(scratch_ptr + slots, mask=slots < count, other=_NONE), K)
    else:
        top = tl.topk(keys, K)
    return top


@triton.jit(do_not_specialize=["width", "k", "stride_out", "logprobs", "sampled_is_top", "num_chunks", "lse_given"])
def _top_k_merge_kernel(chunk_keys_ptr, width, k, values_ptr, ids_ptr, stride_out,
                        logprobs, sampled_is_top, num_chunks, sampled_ptr, sampled_logit_ptr, greater_ptr, ranks_ptr,
                        lse_given, lse_ptr, chunk_max_ptr, chunk_sum_ptr,
                        WIDTH: tl.constexpr, K: tl.constexpr, CHUNKS: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, WIDTH)
    top = tl.topk(tl.load(chunk_keys_ptr + row * width + cols, mask=cols < width, other=_NONE), K)
    values, ids = _unkey(top)
    out = tl.arange(0, K)
    first = logprobs  # 0 or 1
    if logprobs != 0:
        # Logprobs: column 0 the sampled token, then the top k, each its logit minus the row's
        # log-sum-exp; and the sampled token's rank.
        if lse_given != 0:
            lse = tl.load(lse_ptr + row)
        else:
            lse = combined_lse(chunk_max_ptr, chunk_sum_ptr, row, num_chunks, CHUNKS)
        values = values - lse
        if sampled_is_top != 0:
            # A greedy step's token: the top entry (the lowest id among equal maxima, as argmax's).
            tl.store(ids_ptr + row * stride_out, tl.sum(tl.where(out == 0, ids, 0), axis=0))
            tl.store(values_ptr + row * stride_out, tl.sum(tl.where(out == 0, values, 0.0), axis=0))
            tl.store(ranks_ptr + row, tl.full([], 1, tl.int64))
        else:
            tl.store(ids_ptr + row * stride_out, tl.load(sampled_ptr + row))
            tl.store(values_ptr + row * stride_out, tl.load(sampled_logit_ptr + row) - lse)
            greater = tl.load(greater_ptr + row * num_chunks + tl.arange(0, CHUNKS),
                              mask=tl.arange(0, CHUNKS) < num_chunks, other=0)
            tl.store(ranks_ptr + row, tl.sum(greater, axis=0).to(tl.int64) + 1)
    tl.store(values_ptr + row * stride_out + first + out, values, mask=out < k)
    tl.store(ids_ptr + row * stride_out + first + out, ids, mask=out < k)


_launch_top_k_merge = KernelLauncher(_top_k_merge_kernel)


def kernel_width(k: int) -> int:
    """The compiled width that serves ``k`` (1 <= k <= MAX_K)."""
    return next(width for width in WIDTHS if width >= k)


@dataclass
class _Logprobs:
    """The logprobs mode's inputs and outputs (see :func:`top_k_logprobs`)."""

    sampled: torch.Tensor | None  # [B] int64, or None for each row's top entry (a greedy step)
    lse: torch.Tensor | None  # [B] float32, or None to compute it
    ids: torch.Tensor  # [B, 1 + k] int64
    logprobs: torch.Tensor  # [B, 1 + k] float32
    ranks: torch.Tensor  # [B] int64


def top_k(logits: torch.Tensor, k: int, block: int = 4096) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``k`` largest entries of each row of ``logits`` [B, V] (any float dtype, row stride free),
    1 <= k <= min(MAX_K, V): values [B, k] float32 (exactly the logits' values) sorted descending,
    and their ids [B, k] int64; among equal values the lowest ids come first, as in a stable
    descending sort."""
    batch_size, device = logits.shape[0], logits.device
    values = torch.empty(batch_size, k, dtype=torch.float32, device=device)
    ids = torch.empty(batch_size, k, dtype=torch.int64, device=device)
    _launch(logits, k, values, ids, None, block)
    return values, ids


def top_k_logprobs(logits: torch.Tensor, sampled: torch.Tensor | None, num_logprobs: int, lse: torch.Tensor | None,
                   block: int = 4096) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Logprobs of ``logits`` [B, V] (any float dtype) in the same two launches as :func:`top_k`:
    token ids [B, 1 + n] int64 (column 0 the ``sampled`` token [B] int64, then the top
    n = ``num_logprobs`` <= MAX_K as :func:`top_k` orders them), their logprobs [B, 1 + n] float32
    (logit minus the row's log-sum-exp, ``lse`` [B] float32 where given, else computed in the
    pass), and the sampled tokens' ranks [B] int64 (1 + the number of strictly larger logits).
    ``sampled`` None: each row's top entry, the argmax (a greedy step's token, whose rank is 1),
    with no argmax of its own and no ranks counted."""
    batch_size, device = logits.shape[0], logits.device
    mode = _Logprobs(None if sampled is None else sampled.contiguous(), lse,
                     torch.empty(batch_size, 1 + num_logprobs, dtype=torch.int64, device=device),
                     torch.empty(batch_size, 1 + num_logprobs, dtype=torch.float32, device=device),
                     torch.empty(batch_size, dtype=torch.int64, device=device))
    # The top entry at least: the kernels need a k >= 1; the columns past n are not written.
    _launch(logits, max(num_logprobs, 1), mode.logprobs, mode.ids, mode, block, stored=num_logprobs)
    return mode.ids, mode.logprobs, mode.ranks


def _launch(logits: torch.Tensor, k: int, values: torch.Tensor, ids: torch.Tensor, mode: _Logprobs | None,
            block: int, stored: int | None = None) -> None:
    batch_size, vocab_size = logits.shape
    if not 1 <= k <= min(MAX_K, vocab_size):
        raise ValueError(f"k must be in [1, {min(MAX_K, vocab_size)}], got {k}")
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    width = kernel_width(k)
    block = max(min(block, triton.next_power_of_2(vocab_size)), width)
    num_chunks = triton.cdiv(vocab_size, block)
    # The smallest width keeps two keys per group of 256 (0.24 against 0.35 ms at batch 256 on an
    # H200, where about 1% of chunks have three in a group); wider ones would too often.
    two_per_group = width == WIDTHS[0]
    groups = cap = min(256 if two_per_group else 4 * width, block)
    device = logits.device
    scratch = torch.empty(batch_size * num_chunks * cap, dtype=torch.int64, device=device)
    chunk_keys = torch.empty(batch_size, num_chunks * width, dtype=torch.int64, device=device)
    # Absent inputs and outputs are never touched (their flag is off); stand-ins of the same dtypes
    # keep the kernels' signatures, so that both modes launch the same compiled variants.
    sampled = sampled_logit = greater = ranks = lse = chunk_max = chunk_sum = None
    if mode is not None:
        sampled, ranks, lse = mode.sampled, mode.ranks, mode.lse
        if sampled is not None:
            sampled_logit = torch.empty(batch_size, dtype=torch.float32, device=device)
            greater = torch.empty(batch_size, num_chunks, dtype=torch.int32, device=device)
        if lse is None:
            chunk_max = torch.empty(batch_size, num_chunks, dtype=torch.float32, device=device)
            chunk_sum = torch.empty_like(chunk_max)
    int64s = [stand_in(t, torch.int64, device) for t in (sampled, ranks)]
    float32s = [stand_in(t, torch.float32, device) for t in (sampled_logit, lse, chunk_max, chunk_sum)]
    greater = stand_in(greater, torch.int32, device)
    use_sampled, use_lse = int(sampled is not None), int(chunk_max is not None)
    _launch_top_k_chunks[(batch_size, num_chunks)](
        logits, logits.stride(0), vocab_size, num_chunks, scratch, chunk_keys,
        use_sampled, int64s[0], float32s[0], greater, use_lse, float32s[2], float32s[3],
        BLOCK=block, K=width, GROUPS=groups, CAP=cap, TWO_PER_GROUP=two_per_group, num_warps=8)
    _launch_top_k_merge[(batch_size,)](
        chunk_keys, num_chunks * width, k if stored is None else stored, values, ids, values.stride(0),
        int(mode is not None), int(mode is not None and sampled is None), num_chunks, int64s[0], float32s[0],
        greater, int64s[1],
        int(lse is not None), float32s[1], float32s[2], float32s[3],
        WIDTH=triton.next_power_of_2(num_chunks * width), K=width, CHUNKS=triton.next_power_of_2(num_chunks),
        num_warps=8)
