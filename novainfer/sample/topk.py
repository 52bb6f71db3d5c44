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
is sorted instead: the same result, slower. The second launch takes each row's k largest of its
chunks' lists.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

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
def _keys(values, ids):
    """int64 keys of float ``values`` (any float dtype) at token ``ids`` (int64, < 2**32)."""
    bits = values.to(tl.float32).to(tl.int32, bitcast=True)
    # Negative floats order backwards as integers: flipping their magnitude bits fixes that.
    ordered = bits ^ ((bits >> 31) & _LOW31)
    return (ordered.to(tl.int64) << 32) | (_MASK32 - ids)


@triton.jit
def _unkey(keys):
    """(float32 values, int64 ids) of :func:`_keys`' keys."""
    ordered = (keys >> 32).to(tl.int32)
    values = (ordered ^ ((ordered >> 31) & _LOW31)).to(tl.float32, bitcast=True)
    return values, _MASK32 - (keys & _MASK32)


@triton.jit(do_not_specialize=["stride_logits", "vocab_size", "num_chunks"])
def _top_k_chunks_kernel(logits_ptr, stride_logits, vocab_size, num_chunks, scratch_ptr, out_ptr,
                         BLOCK: tl.constexpr, K: tl.constexpr, GROUPS: tl.constexpr, CAP: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    program = row * num_chunks + chunk
    ids = chunk.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    in_vocab = ids < vocab_size
    x = tl.load(logits_ptr + row * stride_logits + ids, mask=in_vocab, other=0.0)
    keys = tl.where(in_vocab, _keys(x, ids), _NONE)
    # Group g holds the entries g, g + GROUPS, ...: strided, so that runs of neighbouring ids with
    # large (or equal) values spread over many groups.
    group_max = tl.max(tl.reshape(keys, [BLOCK // GROUPS, GROUPS]), axis=0)
    threshold = tl.min(tl.topk(group_max, K), axis=0)
    candidate = keys >= threshold
    count = tl.sum(candidate.to(tl.int32), axis=0)
    if count <= CAP:
        slot = tl.cumsum(candidate.to(tl.int32), axis=0) - 1
        tl.store(scratch_ptr + program * CAP + slot, keys, mask=candidate)
        # The slots were written by other threads of the program.
        tl.debug_barrier()
        slots = tl.arange(0, CAP)
        top = tl.topk(tl.load(scratch_ptr + program * CAP + slots, mask=slots < count, other=_NONE), K)
    else:
        top = tl.topk(keys, K)
    tl.store(out_ptr + program * K + tl.arange(0, K), top)


@triton.jit(do_not_specialize=["width", "k"])
def _top_k_merge_kernel(chunk_keys_ptr, width, k, values_ptr, ids_ptr, WIDTH: tl.constexpr, K: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, WIDTH)
    top = tl.topk(tl.load(chunk_keys_ptr + row * width + cols, mask=cols < width, other=_NONE), K)
    values, ids = _unkey(top)
    out = tl.arange(0, K)
    tl.store(values_ptr + row * k + out, values, mask=out < k)
    tl.store(ids_ptr + row * k + out, ids, mask=out < k)


def kernel_width(k: int) -> int:
    """The compiled width that serves ``k`` (1 <= k <= MAX_K)."""
    return next(width for width in WIDTHS if width >= k)


def top_k(logits: torch.Tensor, k: int, block: int = 4096) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``k`` largest entries of each row of ``logits`` [B, V] (any float dtype, row stride free,
    unit column stride), 1 <= k <= min(MAX_K, V): values [B, k] float32 (exactly the logits'
    values) sorted descending, and their ids [B, k] int64; among equal values the lowest ids come
    first, as in a stable descending sort."""
    batch_size, vocab_size = logits.shape
    if not 1 <= k <= min(MAX_K, vocab_size):
        raise ValueError(f"k must be in [1, {min(MAX_K, vocab_size)}], got {k}")
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    width = kernel_width(k)
    block = max(min(block, triton.next_power_of_2(vocab_size)), width)
    num_chunks = triton.cdiv(vocab_size, block)
    groups = cap = min(4 * width, block)
    device = logits.device
    scratch = torch.empty(batch_size * num_chunks * cap, dtype=torch.int64, device=device)
    chunk_keys = torch.empty(batch_size, num_chunks * width, dtype=torch.int64, device=device)
    _top_k_chunks_kernel[(batch_size, num_chunks)](logits, logits.stride(0), vocab_size, num_chunks, scratch,
                                                   chunk_keys, BLOCK=block, K=width, GROUPS=groups, CAP=cap,
                                                   num_warps=8)
    values = torch.empty(batch_size, k, dtype=torch.float32, device=device)
    ids = torch.empty(batch_size, k, dtype=torch.int64, device=device)
    _top_k_merge_kernel[(batch_size,)](chunk_keys, num_chunks * width, k, values, ids,
                                       WIDTH=triton.next_power_of_2(num_chunks * width), K=width, num_warps=8)
    return values, ids
