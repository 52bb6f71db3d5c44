"""Top-k of each row of [B, V] logits for small k (Triton, CUDA): the sampler's top-k candidates and
its logprobs' top alternatives, in place of ``torch.topk`` (a radix select of several passes).

Entries are compared as int64 keys: the float32 value's bits mapped to an order-preserving signed
integer in the high half, the complement of the token id in the low half. Keys are distinct, so the
k largest keys are well defined: the k largest values, and among equal values the lowest ids (the
order of a stable descending sort). -0.0 ranks below +0.0 and NaN above +inf (or, for a negative
NaN, below -inf): a stable sort compares them otherwise, but they are values that compare equal
or broken logits.

Four launches, two of them reading the row once each, and no sort over a chunk of the row in the
common case (k below is the compiled width that serves the k asked for). The first cuts each row
into chunks of ``BLOCK`` and writes the maxima of each chunk's ``GROUPS`` strided groups. The
second takes a row's threshold, the k-th largest of all its groups' maxima: k groups have a maximum
at or above it, so at least k entries are, and the row's k largest are among the entries at or
above it: for logits with no structure, a little over k of a 151,936-token row's entries, whose 608
maxima are at least four per wanted entry. The third appends each chunk's entries at or above the
threshold to the row's candidates (an atomic counter on the row gives each its slot); where more
than k of a chunk's reach it (many equal values, a row of ``-inf`` or NaN logits, or the largest
values crowded into few groups), it appends the chunk's k largest instead (a bitonic top-k over the
chunk, ``tl.topk``): the same result, slower. So a row never gets more than k candidates per chunk.
The fourth sorts each row's candidates only.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from novainfer.layers.ops.launcher import KernelLauncher, Launch, LaunchPlans, ScratchSpec
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
# At or below every ordered_key of a value (-inf's and negative NaNs' included): the padding past the
# vocabulary among 32-bit keys.
_BELOW32 = tl.constexpr(-(2**31))


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
def _group_maxima_kernel(logits_ptr, stride_logits, vocab_size, num_chunks, maxima_ptr, counts_ptr,
                         use_sampled, sampled_ptr, sampled_logit_ptr, greater_ptr, use_lse, chunk_max_ptr,
                         chunk_sum_ptr, BLOCK: tl.constexpr, GROUPS: tl.constexpr):
    """Per chunk: the maxima of its ``GROUPS`` strided groups (as :func:`ordered_key` keys), and the
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
    # Group g holds the entries g, g + GROUPS, ...: strided, so that runs of neighbouring ids with
    # large (or equal) values spread over many groups.
    keys = tl.where(in_vocab, ordered_key(x), _BELOW32)
    group_max = tl.max(tl.reshape(keys, [BLOCK // GROUPS, GROUPS]), axis=0)
    tl.store(maxima_ptr + program * GROUPS + tl.arange(0, GROUPS), group_max)
    if chunk == 0:
        tl.store(counts_ptr + row, 0)  # the collection's counter, first read by the next launch but one


_launch_group_maxima = KernelLauncher(_group_maxima_kernel)


@triton.jit(do_not_specialize=["num_maxima"])
def _row_threshold_kernel(maxima_ptr, num_maxima, thresholds_ptr, MAXIMA: tl.constexpr, K: tl.constexpr):
    """A row's threshold: the K-th largest of its groups' maxima (K groups have a maximum at or above
    it, so at least K entries are)."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, MAXIMA)
    maxima = tl.load(maxima_ptr + row * num_maxima + cols, mask=cols < num_maxima, other=_BELOW32)
    tl.store(thresholds_ptr + row, tl.min(tl.topk(maxima, K), axis=0))


_launch_row_thresholds = KernelLauncher(_row_threshold_kernel)


@triton.jit(do_not_specialize=["stride_logits", "vocab_size", "row_slots"])
def _collect_candidates_kernel(logits_ptr, stride_logits, vocab_size, thresholds_ptr, counts_ptr, candidates_ptr,
                               row_slots, BLOCK: tl.constexpr, K: tl.constexpr):
    """Appends the chunk's entries at or above the row's threshold to the row's candidates as int64
    keys, or, where more than K reach it, the chunk's K largest: at most K per chunk, so the row's
    ``row_slots`` (K per chunk) always hold them."""
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    ids = chunk.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    in_vocab = ids < vocab_size
    x = tl.load(logits_ptr + row * stride_logits + ids, mask=in_vocab, other=float("-inf")).to(tl.float32)
    candidate = in_vocab & (ordered_key(x) >= tl.load(thresholds_ptr + row))
    count = tl.sum(candidate.to(tl.int32), axis=0)
    row_candidates = candidates_ptr + row * row_slots
    if count <= K:
        if count > 0:
            # One atomic per candidate (a chunk has about two): cheaper than a prefix sum over the chunk.
            slot = tl.atomic_add(counts_ptr + row + tl.zeros([BLOCK], tl.int64), tl.full([BLOCK], 1, tl.int32),
                                 mask=candidate)
            tl.store(row_candidates + slot, _keys(x, ids), mask=candidate)
    else:
        start = tl.atomic_add(counts_ptr + row, K)
        tl.store(row_candidates + start + tl.arange(0, K), tl.topk(tl.where(in_vocab, _keys(x, ids), _NONE), K))


_launch_collect_candidates = KernelLauncher(_collect_candidates_kernel)


@triton.jit
def _float_bits(x):
    """The bit pattern of float32 ``x`` as a sign-extended int64 (how LogprobsTensors.pack keeps it)."""
    return x.to(tl.int32, bitcast=True).to(tl.int64)


@triton.jit(do_not_specialize=["row_slots", "k", "stride_out", "logprobs", "sampled_is_top", "num_chunks",
                               "lse_given"])
def _top_k_merge_kernel(candidates_ptr, counts_ptr, row_slots, k, values_ptr, ids_ptr, stride_out,
                        logprobs, sampled_is_top, num_chunks, sampled_ptr, sampled_logit_ptr, greater_ptr,
                        lse_given, lse_ptr, chunk_max_ptr, chunk_sum_ptr,
                        SLOTS: tl.constexpr, FEW: tl.constexpr, K: tl.constexpr, CHUNKS: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    count = tl.load(counts_ptr + row)
    row_candidates = candidates_ptr + row * row_slots
    # Typically about K candidates: a sort of FEW slots; all SLOTS where more (many equal values).
    if count <= FEW:
        few = tl.arange(0, FEW)
        top = tl.topk(tl.load(row_candidates + few, mask=few < count, other=_NONE), K)
    else:
        slots = tl.arange(0, SLOTS)
        top = tl.topk(tl.load(row_candidates + slots, mask=slots < count, other=_NONE), K)
    values, ids = _unkey(top)
    out = tl.arange(0, K)
    if logprobs != 0:
        # Logprobs, in one int64 row of ids_ptr laid out as LogprobsTensors.pack lays them out: the
        # sampled token's rank, the token ids (the sampled token, then the top k), then their
        # logprobs' float32 bits (logit minus the row's log-sum-exp).
        if lse_given != 0:
            lse = tl.load(lse_ptr + row)
        else:
            lse = combined_lse(chunk_max_ptr, chunk_sum_ptr, row, num_chunks, CHUNKS)
        values = values - lse
        if sampled_is_top != 0:
            # A greedy step's token: the top entry (the lowest id among equal maxima, as argmax's).
            sampled_id = tl.sum(tl.where(out == 0, ids, 0), axis=0)
            sampled_value = tl.sum(tl.where(out == 0, values, 0.0), axis=0)
            rank = tl.full([], 1, tl.int64)
        else:
            sampled_id = tl.load(sampled_ptr + row)
            sampled_value = tl.load(sampled_logit_ptr + row) - lse
            greater = tl.load(greater_ptr + row * num_chunks + tl.arange(0, CHUNKS),
                              mask=tl.arange(0, CHUNKS) < num_chunks, other=0)
            rank = tl.sum(greater, axis=0).to(tl.int64) + 1
        packed = ids_ptr + row * stride_out
        bits = packed + 2 + k
        tl.store(packed, rank)
        tl.store(packed + 1, sampled_id)
        tl.store(bits, _float_bits(sampled_value))
        tl.store(packed + 2 + out, ids, mask=out < k)
        tl.store(bits + 1 + out, _float_bits(values), mask=out < k)
    else:
        tl.store(values_ptr + row * stride_out + out, values, mask=out < k)
        tl.store(ids_ptr + row * stride_out + out, ids, mask=out < k)


_launch_top_k_merge = KernelLauncher(_top_k_merge_kernel)


def kernel_width(k: int) -> int:
    """The compiled width that serves ``k`` (1 <= k <= MAX_K)."""
    return next(width for width in WIDTHS if width >= k)


@dataclass
class _Logprobs:
    """The logprobs mode's inputs and output (see :func:`top_k_logprobs`)."""

    sampled: torch.Tensor | None  # [B] int64, or None for each row's top entry (a greedy step)
    lse: torch.Tensor | None  # [B] float32, or None to compute it
    packed: torch.Tensor  # [B, 1 + 2 (1 + n)] int64: ranks, ids, logprobs' bits


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
                   block: int = 4096) -> torch.Tensor:
    """Logprobs of ``logits`` [B, V] (any float dtype) in the same launches as :func:`top_k`, as
    the int64 tensor [B, 1 + 2 (1 + n)] that novainfer.sample.sampler.LogprobsTensors holds (and
    copies to the host as it is): per row the sampled token's rank (1 + the number of strictly
    larger logits), the token ids (the ``sampled`` token [B] int64, then the top n =
    ``num_logprobs`` <= MAX_K as :func:`top_k` orders them), then their logprobs' float32 bits
    (logit minus the row's log-sum-exp, ``lse`` [B] float32 where given, else computed in the
    pass). ``sampled`` None: each row's top entry, the argmax (a greedy step's token, whose rank
    is 1), with no argmax of its own and no ranks counted."""
    batch_size, width = logits.shape[0], 1 + num_logprobs
    mode = _Logprobs(None if sampled is None else sampled.contiguous(), None if lse is None else lse.contiguous(),
                     torch.empty(batch_size, 1 + 2 * width, dtype=torch.int64, device=logits.device))
    # The top entry at least: the kernels need a k >= 1; the columns past n are not written.
    _launch(logits, max(num_logprobs, 1), None, mode.packed, mode, block, stored=num_logprobs)
    return mode.packed


def _launch(logits: torch.Tensor, k: int, values: torch.Tensor | None, ids: torch.Tensor, mode: _Logprobs | None,
            block: int, stored: int | None = None) -> None:
    """The four launches. ``values`` and ``ids``: the top k's [B, k] outputs, or (``mode``) None and
    the packed logprobs. A shape seen before repeats its kept launches (LaunchPlans)."""
    batch_size, vocab_size = logits.shape
    if not 1 <= k <= min(MAX_K, vocab_size):
        raise ValueError(f"k must be in [1, {min(MAX_K, vocab_size)}], got {k}")
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    sampled, lse = (None, None) if mode is None else (mode.sampled, mode.lse)
    variable = (logits, ids, values, sampled, lse)

    def build() -> tuple[ScratchSpec, Callable[[list[torch.Tensor]], list[Launch]]]:
        shape = _Shape.of(logits, k, mode, block, stored)
        return shape.scratch(), functools.partial(_launches, shape, variable)

    key = (batch_size, vocab_size, logits.stride(0), logits.dtype, k, stored, block, mode is None)
    _PLANS.launch(logits.device, key, variable, build)


_PLANS = LaunchPlans()


@dataclass(frozen=True)
class _Shape:
    """Sizes of one call's launches."""

    batch_size: int
    vocab_size: int
    k: int  # the entries the merge keeps (``stored``) where that differs from the k computed
    width: int
    block: int
    num_chunks: int
    groups: int
    has_sampled: bool
    has_lse: bool
    logprobs: bool

    @classmethod
    def of(cls, logits: torch.Tensor, k: int, mode: _Logprobs | None, block: int, stored: int | None) -> _Shape:
        batch_size, vocab_size = logits.shape
        width = kernel_width(k)
        block = max(min(block, triton.next_power_of_2(vocab_size)), width)
        num_chunks = triton.cdiv(vocab_size, block)
        # At least four maxima per wanted entry (and 16 groups per chunk): the threshold is then
        # reached by few entries beyond the k largest.
        groups = min(block, max(16, triton.next_power_of_2(triton.cdiv(4 * width, num_chunks))))
        return cls(batch_size, vocab_size, k if stored is None else stored, width, block, num_chunks, groups,
                   mode is not None and mode.sampled is not None, mode is not None and mode.lse is not None,
                   mode is not None)

    def scratch(self) -> ScratchSpec:
        """The kernels' scratch buffers: group maxima, thresholds, candidate counts, candidates, then
        the sampled token's logit and the counts of larger logits, then the chunks' maxima and sums
        for the log-sum-exp (each of the last two pairs only where the mode reads it)."""
        b, c = self.batch_size, self.num_chunks
        buffers = [((b, c * self.groups), torch.int32), ((b,), torch.int32), ((b,), torch.int32),
                   ((b, c * self.width), torch.int64)]
        if self.has_sampled:
            buffers += [((b,), torch.float32), ((b, c), torch.int32)]
        if self.logprobs and not self.has_lse:
            buffers += [((b, c), torch.float32), ((b, c), torch.float32)]
        return buffers


def _launches(shape: _Shape, variable: tuple, scratch: list[torch.Tensor]) -> list[Launch]:
    """The four launches on ``variable`` (logits, ids, values, sampled, lse) and ``scratch``
    (:meth:`_Shape.scratch`)."""
    logits, ids, values, sampled, lse = variable
    device = logits.device
    maxima, thresholds, counts, candidates, *rest = scratch
    sampled_logit = greater = chunk_max = chunk_sum = None
    if shape.has_sampled:
        sampled_logit, greater, *rest = rest
    if rest:
        chunk_max, chunk_sum = rest
    # Absent inputs and outputs are never touched (their flag is off); stand-ins of the same dtypes
    # keep the kernels' signatures, so that both modes launch the same compiled variants.
    sampled_or_stand_in = stand_in(sampled, torch.int64, device)
    float32s = [stand_in(t, torch.float32, device) for t in (sampled_logit, lse, chunk_max, chunk_sum)]
    greater = stand_in(greater, torch.int32, device)
    batch_size, num_chunks, width = shape.batch_size, shape.num_chunks, shape.width
    slots = triton.next_power_of_2(candidates.shape[1])
    return [
        (_launch_group_maxima, (batch_size, num_chunks),
         (logits, logits.stride(0), shape.vocab_size, num_chunks, maxima, counts, int(shape.has_sampled),
          sampled_or_stand_in, float32s[0], greater, int(chunk_max is not None), float32s[2], float32s[3]),
         dict(BLOCK=shape.block, GROUPS=shape.groups, num_warps=8)),
        (_launch_row_thresholds, (batch_size,), (maxima, maxima.shape[1], thresholds),
         dict(MAXIMA=triton.next_power_of_2(maxima.shape[1]), K=width, num_warps=8)),
        (_launch_collect_candidates, (batch_size, num_chunks),
         (logits, logits.stride(0), shape.vocab_size, thresholds, counts, candidates, candidates.shape[1]),
         dict(BLOCK=shape.block, K=width, num_warps=8)),
        (_launch_top_k_merge, (batch_size,),
         (candidates, counts, candidates.shape[1], shape.k, stand_in(values, torch.float32, device), ids,
          ids.stride(0), int(shape.logprobs), int(shape.logprobs and not shape.has_sampled), num_chunks,
          sampled_or_stand_in, float32s[0], greater, int(shape.has_lse), float32s[1], float32s[2], float32s[3]),
         dict(SLOTS=slots, FEW=min(4 * width, slots), K=width, CHUNKS=triton.next_power_of_2(num_chunks),
              num_warps=8)),
    ]
