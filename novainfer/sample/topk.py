"""Top-k of each row of [B, V] logits for small k (Triton, CUDA): the sampler's top-k candidates and
its logprobs' top alternatives, in place of ``torch.topk`` (a radix select of several passes).

Entries are compared as int64 keys: the float32 value's bits mapped to an order-preserving signed
integer in the high half, the complement of the token id in the low half. Keys are distinct, so the
k largest keys are well defined: the k largest values, and among equal values the lowest ids (the
order of a stable descending sort). -0.0 ranks below +0.0 and NaN above +inf (or, for a negative
NaN, below -inf): a stable sort compares them otherwise, but they are values that compare equal
or broken logits.

A row threshold first, then a sort of the few entries that reach it; four launches. The first
cuts each row into chunks, splits each chunk into ``GROUPS`` >= k strided groups and keeps the k
largest group maxima of the chunk. The second takes the k-th largest of the row's kept maxima: k
distinct entries reach it (those group maxima), so the row's k largest all do, and for the logits
a model gives, few others do. The third appends the entries at or above the threshold to the
row's candidates (an atomic counter gives each chunk its slots), in a buffer of
``CANDIDATES_PER_K * k``; the fourth sorts each row's candidates only (a bitonic top-k,
``tl.topk``). A row with more candidates than the buffer holds (many entries equal at the
threshold: a row of equal, ``-inf`` or NaN logits) is scanned whole in the fourth launch instead,
chunk by chunk: the same result, slower. Passes over the whole row compare the float32 value's
32-bit ordered key; int64 keys are made for the candidates alone.
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
# Below every ordered_key of a value (-inf's and negative NaNs' included): the padding past the vocabulary.
_BELOW32 = tl.constexpr(-(2**31))
# Candidate slots per row, per unit of the kernel's width.
CANDIDATES_PER_K = 8


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
def _chunk_maxima_kernel(logits_ptr, stride_logits, vocab_size, num_chunks, maxima_ptr,
                         use_sampled, sampled_ptr, sampled_logit_ptr, greater_ptr, use_lse, chunk_max_ptr,
                         chunk_sum_ptr, BLOCK: tl.constexpr, K: tl.constexpr, GROUPS: tl.constexpr):
    """Per chunk: the K largest maxima of its strided groups (as :func:`ordered_key` keys), and the
    logprobs mode's per-chunk parts."""
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
    keys = tl.where(in_vocab, ordered_key(x), _BELOW32)
    # Group g holds the entries g, g + GROUPS, ...: strided, so that runs of neighbouring ids with
    # large (or equal) values spread over many groups.
    group_max = tl.max(tl.reshape(keys, [BLOCK // GROUPS, GROUPS]), axis=0)
    tl.store(maxima_ptr + program * K + tl.arange(0, K), tl.topk(group_max, K))


_launch_chunk_maxima = KernelLauncher(_chunk_maxima_kernel)


@triton.jit(do_not_specialize=["width"])
def _row_threshold_kernel(maxima_ptr, width, thresholds_ptr, counts_ptr, K: tl.constexpr, WIDTH: tl.constexpr):
    """Per row: the K-th largest of its group maxima (K distinct entries reach it, and so do the
    row's K largest), and the collection's counter set to 0."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, WIDTH)
    maxima = tl.load(maxima_ptr + row * width + cols, mask=cols < width, other=_BELOW32)
    tl.store(thresholds_ptr + row, tl.min(tl.topk(maxima, K), axis=0))
    tl.store(counts_ptr + row, 0)


_launch_row_threshold = KernelLauncher(_row_threshold_kernel)


@triton.jit(do_not_specialize=["stride_logits", "vocab_size", "cap"])
def _collect_candidates_kernel(logits_ptr, stride_logits, vocab_size, thresholds_ptr, counts_ptr, candidates_ptr,
                               cap, BLOCK: tl.constexpr):
    """Appends the chunk's keys at or above the row's threshold to the row's candidates; slots past
    ``cap`` are counted but not written."""
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    ids = chunk.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    in_vocab = ids < vocab_size
    x = tl.load(logits_ptr + row * stride_logits + ids, mask=in_vocab, other=float("-inf")).to(tl.float32)
    candidate = in_vocab & (ordered_key(x) >= tl.load(thresholds_ptr + row))
    count = tl.sum(candidate.to(tl.int32), axis=0)
    if count > 0:
        start = tl.atomic_add(counts_ptr + row, count)
        slot = start + tl.cumsum(candidate.to(tl.int32), axis=0) - 1
        tl.store(candidates_ptr + row * cap + slot, _keys(x, ids), mask=candidate & (slot < cap))


_launch_collect_candidates = KernelLauncher(_collect_candidates_kernel)


@triton.jit
def _row_top_k(row_ptr, vocab_size, num_chunks, K: tl.constexpr, BLOCK: tl.constexpr):
    """The K largest keys of a whole row, chunk by chunk (the path of rows whose candidates overflow)."""
    top = tl.full([K], _NONE, tl.int64)
    for chunk in range(num_chunks):
        ids = tl.arange(0, BLOCK).to(tl.int64) + chunk * BLOCK
        in_vocab = ids < vocab_size
        x = tl.load(row_ptr + ids, mask=in_vocab, other=float("-inf")).to(tl.float32)
        keys = tl.where(in_vocab, _keys(x, ids), _NONE)
        top = tl.topk(tl.reshape(tl.join(top, tl.topk(keys, K)), [2 * K]), K)
    return top


@triton.jit(do_not_specialize=["cap", "stride_logits", "vocab_size", "k", "stride_out", "logprobs", "sampled_is_top",
                               "num_chunks", "lse_given"])
def _select_top_k_kernel(candidates_ptr, counts_ptr, cap, logits_ptr, stride_logits, vocab_size, k, values_ptr,
                         ids_ptr, stride_out, logprobs, sampled_is_top, num_chunks, sampled_ptr, sampled_logit_ptr,
                         greater_ptr, ranks_ptr, lse_given, lse_ptr, chunk_max_ptr, chunk_sum_ptr,
                         CAP: tl.constexpr, K: tl.constexpr, CHUNKS: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    count = tl.load(counts_ptr + row)
    if count <= cap:
        slots = tl.arange(0, CAP)
        top = tl.topk(tl.load(candidates_ptr + row * cap + slots, mask=slots < count, other=_NONE), K)
    else:
        # Many entries equal at the threshold (a row of equal or broken logits): the whole row.
        top = _row_top_k(logits_ptr + row * stride_logits, vocab_size, num_chunks, K, BLOCK)
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


_launch_select_top_k = KernelLauncher(_select_top_k_kernel)


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
    groups = min(256, block)  # >= width: every width divides 256, and block >= width
    # A row's candidates: typically little more than k.
    cap = CANDIDATES_PER_K * width
    device = logits.device
    maxima = torch.empty(batch_size, num_chunks * width, dtype=torch.int32, device=device)
    thresholds = torch.empty(batch_size, dtype=torch.int32, device=device)
    counts = torch.empty(batch_size, dtype=torch.int32, device=device)
    candidates = torch.empty(batch_size, cap, dtype=torch.int64, device=device)
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
    chunks_pad = triton.next_power_of_2(num_chunks)
    _launch_chunk_maxima[(batch_size, num_chunks)](
        logits, logits.stride(0), vocab_size, num_chunks, maxima,
        use_sampled, int64s[0], float32s[0], greater, use_lse, float32s[2], float32s[3],
        BLOCK=block, K=width, GROUPS=groups, num_warps=8)
    _launch_row_threshold[(batch_size,)](maxima, num_chunks * width, thresholds, counts, K=width,
                                         WIDTH=triton.next_power_of_2(num_chunks * width), num_warps=8)
    _launch_collect_candidates[(batch_size, num_chunks)](
        logits, logits.stride(0), vocab_size, thresholds, counts, candidates, cap, BLOCK=block, num_warps=8)
    _launch_select_top_k[(batch_size,)](
        candidates, counts, cap, logits, logits.stride(0), vocab_size, k if stored is None else stored, values, ids,
        values.stride(0), int(mode is not None), int(mode is not None and sampled is None), num_chunks, int64s[0],
        float32s[0], greater, int64s[1], int(lse is not None), float32s[1], float32s[2], float32s[3],
        CAP=cap, K=width, CHUNKS=chunks_pad, BLOCK=block, num_warps=8)
