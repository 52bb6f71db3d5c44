"""Custom all-reduces for small tensors between GPUs that can read each other's memory (NVLink).

A decode step all-reduces a few megabytes twice per decoder layer. NCCL's ring algorithms take
tens of microseconds for that; here every rank copies its tensor into a buffer every peer can
read, the ranks meet at flag barriers, and the sum happens in one kernel, of one of two kinds:

* one-shot: after one barrier each rank sums every rank's buffer itself. One round of reads, but
  each rank reads ``world_size - 1`` whole tensors over NVLink.
* two-shot: the tensor is cut into blocks dealt round-robin to the ranks. After a first barrier
  each rank sums only its own blocks over every buffer and writes the sums back into its buffer
  (a reduce-scatter); after a second barrier it copies the other blocks' sums from their owners'
  buffers (an all-gather). Each rank reads ``2 (world_size - 1) / world_size`` tensors: half of
  the one-shot's bytes at four ranks, for one more barrier; as many at two ranks.

``CustomAllReduce.all_reduce`` takes the two-shot with more than two ranks for tensors of at
least ``TWO_SHOT_MIN_BYTES`` (below that the second barrier's latency costs more than the bytes
it saves), the one-shot otherwise. Both sum every element in float32 in rank order and round it
once, so every rank gets the same bits, and the same bits from either kernel. Larger tensors
(prefill steps) stay with NCCL, whose ring moves fewer bytes per rank.

The kernels keep no host state between calls, so CUDA graphs can capture them: each program keeps
its own call counter in device memory, and a call's flags carry that counter. The grid is the same
for every call, so every program's counter stays equal to the number of calls, and both kernels
advance the same counters by one per call: the call number means the same to both. Call ``k``'s
barriers set flags to ``2k - 1`` (the two-shot's first) and ``2k`` (the one-shot's only, the
two-shot's second); a barrier waits until each peer's flag is at least its value, and flags only
grow, so whatever mix of kernels came before, a barrier passes only once every peer has reached
it. Counters and flags are int32: they wrap around after 2**31 calls (2**30 for the flags, days of
decoding), so barriers compare by difference and halves are chosen by the low bit, which both
survive the wrap.

Within a call, program ``p`` of each rank only reads what program ``p`` of every rank wrote before
the barrier they last met at: the one-shot deals out chunks of ``BLOCK`` elements, the two-shot
super blocks of ``world_size`` blocks, program ``p`` taking numbers ``p, p + P, ...`` of them in
every step. Between its two barriers the two-shot overwrites only a rank's own blocks, which no
peer reads before the second.

Buffers alternate between two halves by call parity, so a rank one call ahead of a peer writes
the other half. A rank cannot get two calls ahead: its kernel of call ``k + 2`` starts once its
kernel of call ``k + 1`` is over, which passed barriers that every peer's kernel of call ``k + 1``
reached, and a peer's stream starts that kernel only once its kernel of call ``k`` is over, reads
of the half included. This holds for all programs at once, so it holds when the partitions of
two calls differ (one-shot chunks, two-shot super blocks), where the pairing of programs at the
barriers alone would not.

Ranks share their buffers by pointer when they are threads of one process (``uni``; peer access is
enabled) and by CUDA IPC handle when they are processes (``mp``). CuPy provides both runtime calls.
"""

from __future__ import annotations

import math
import os
import struct
from collections.abc import Callable

import torch
import triton
import triton.language as tl

# Above this many bytes NCCL's ring is as fast or faster (one-shot reads world_size x the bytes).
DEFAULT_MAX_BYTES = 4 * 1024 * 1024
# From this many bytes, with more than two ranks, the two-shot kernel runs; benchmarks/all_reduce.py
# times both kernels per size to set it.
TWO_SHOT_MIN_BYTES = 1024 * 1024
_BLOCK = 2048
_NUM_WARPS = 8
# Programs per multiprocessor; all of them must be resident at once (they wait for each other's peers).
_PROGRAMS_PER_SM = 1
_MAX_PROGRAMS_PER_SM = 4
# Ranks a barrier serves (one lane each); larger groups keep to the group's backend.
MAX_WORLD_SIZE: tl.constexpr = tl.constexpr(8)
_SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_CUDA_IPC_MEM_LAZY_ENABLE_PEER_ACCESS = 1
_CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED = 704
# What each rank publishes: pid, device index, SM count, buffer pointer, IPC handle (64 bytes).
_RECORD = struct.Struct("<qqqq64s")


@triton.jit
def _start_call(counters_ptr, pid, half_elements):
    """This program's call number (counted from 1) and the offset of the buffer half it uses."""
    call = tl.load(counters_ptr + pid) + 1
    return call, (call & 1).to(tl.int64) * half_elements


@triton.jit
def _buffer(buffer_ptrs, rank, half, dtype: tl.constexpr):
    """``rank``'s buffer half as a ``dtype`` pointer."""
    # Buffers are 16-byte aligned; saying so lets the copies use 16-byte vector accesses.
    return tl.multiple_of(tl.load(buffer_ptrs + rank).to(tl.pointer_type(dtype)), 16) + half


@triton.jit
def _barrier(signal_ptrs, pid, value, RANK: tl.constexpr, WORLD_SIZE: tl.constexpr):
    """Meets program ``pid`` of every rank: releases this program's writes, acquires the peers'.

    Sets this rank's flag in every rank's array to ``value``, then waits until every flag in this
    rank's array is at least ``value``. One lane per peer does both, so the ranks' release fences
    and flag polls overlap instead of running one after another. The difference is compared, not
    the values, so that the wait stays right when the int32 flags wrap around.
    """
    lanes = tl.arange(0, MAX_WORLD_SIZE)
    live = lanes < WORLD_SIZE
    tl.debug_barrier()  # every thread's writes are done before the release
    peer_flags = tl.load(signal_ptrs + lanes, mask=live, other=0).to(tl.pointer_type(tl.int32))
    tl.atomic_xchg(peer_flags + pid * WORLD_SIZE + RANK, value, mask=live, sem="release", scope="sys")
    own_flags = tl.load(signal_ptrs + RANK).to(tl.pointer_type(tl.int32)) + pid * WORLD_SIZE + lanes
    behind = 1
    while behind > 0:
        seen = tl.atomic_add(own_flags, 0, mask=live, sem="acquire", scope="sys")
        behind = tl.sum(tl.where(live & (seen - value < 0), 1, 0))
    tl.debug_barrier()  # no thread reads the peers' data before the acquire


@triton.jit
def _rank_order_sum(buffer_ptrs, half, offs, mask, dtype: tl.constexpr, WORLD_SIZE: tl.constexpr,
                    BLOCK: tl.constexpr):
    """These elements summed over every rank's buffer in rank order in float32, rounded once to
    ``dtype``: the same bits whichever rank, and whichever kernel, computes them."""
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for peer in tl.static_range(WORLD_SIZE):
        # .cg: read at L2, where other GPUs' writes land; every element is read once anyway.
        acc += tl.load(_buffer(buffer_ptrs, peer, half, dtype) + offs, mask=mask,
                       cache_modifier=".cg").to(tl.float32)
    return acc.to(dtype)


@triton.jit
def _one_shot_all_reduce_kernel(tensor_ptr, buffer_ptrs, signal_ptrs, counters_ptr, n_elements, half_elements,
                                RANK: tl.constexpr, WORLD_SIZE: tl.constexpr, BLOCK: tl.constexpr):
    """Program ``p`` takes chunks ``p, p + P, ...`` of BLOCK elements: copies them into this rank's
    buffer, meets the peers once, and sums every rank's copies into the tensor."""
    pid = tl.program_id(0)
    stride = tl.num_programs(0) * BLOCK
    dtype = tensor_ptr.dtype.element_ty
    call, half = _start_call(counters_ptr, pid, half_elements)
    own = _buffer(buffer_ptrs, RANK, half, dtype)
    # 1. This program's chunks of the input into this rank's buffer.
    for start in range(pid * BLOCK, n_elements, stride):
        offs = start + tl.arange(0, BLOCK)
        mask = offs < n_elements
        tl.store(own + offs, tl.load(tensor_ptr + offs, mask=mask), mask=mask)
    # 2. Every rank's chunks are in place.
    _barrier(signal_ptrs, pid, 2 * call, RANK, WORLD_SIZE)
    # 3. Sum every rank's chunks into the tensor.
    for start in range(pid * BLOCK, n_elements, stride):
        offs = start + tl.arange(0, BLOCK)
        mask = offs < n_elements
        tl.store(tensor_ptr + offs, _rank_order_sum(buffer_ptrs, half, offs, mask, dtype, WORLD_SIZE, BLOCK),
                 mask=mask)
    tl.store(counters_ptr + pid, call)


@triton.jit
def _two_shot_all_reduce_kernel(tensor_ptr, buffer_ptrs, signal_ptrs, counters_ptr, n_elements, half_elements,
                                RANK: tl.constexpr, WORLD_SIZE: tl.constexpr, BLOCK: tl.constexpr):
    """Program ``p`` takes super blocks ``p, p + P, ...`` of WORLD_SIZE blocks of BLOCK elements;
    rank ``r`` owns block ``r`` of each. Copies the super blocks into this rank's buffer, meets the
    peers, sums its own blocks over every buffer (into the tensor and back into its buffer), meets
    the peers again, and copies the other blocks' sums from their owners' buffers."""
    pid = tl.program_id(0)
    SUPER: tl.constexpr = WORLD_SIZE * BLOCK
    stride = tl.num_programs(0) * SUPER
    dtype = tensor_ptr.dtype.element_ty
    call, half = _start_call(counters_ptr, pid, half_elements)
    own = _buffer(buffer_ptrs, RANK, half, dtype)
    # 1. This program's super blocks of the input into this rank's buffer.
    for start in range(pid * SUPER, n_elements, stride):
        for block in tl.static_range(WORLD_SIZE):
            offs = start + block * BLOCK + tl.arange(0, BLOCK)
            mask = offs < n_elements
            tl.store(own + offs, tl.load(tensor_ptr + offs, mask=mask), mask=mask)
    # 2. Every rank's super blocks are in place.
    _barrier(signal_ptrs, pid, 2 * call - 1, RANK, WORLD_SIZE)
    # 3. Reduce-scatter: the sums of this rank's blocks, into the tensor and over its input in its
    #    buffer (the peers read only their own blocks in this step, this rank's after the barrier).
    for start in range(pid * SUPER, n_elements, stride):
        offs = start + RANK * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n_elements
        total = _rank_order_sum(buffer_ptrs, half, offs, mask, dtype, WORLD_SIZE, BLOCK)
        tl.store(tensor_ptr + offs, total, mask=mask)
        tl.store(own + offs, total, mask=mask)
    # 4. Every rank's sums are in place.
    _barrier(signal_ptrs, pid, 2 * call, RANK, WORLD_SIZE)
    # 5. All-gather: the other blocks' sums from their owners' buffers.
    for start in range(pid * SUPER, n_elements, stride):
        for owner in tl.static_range(WORLD_SIZE):
            if owner != RANK:
                offs = start + owner * BLOCK + tl.arange(0, BLOCK)
                mask = offs < n_elements
                sums = _buffer(buffer_ptrs, owner, half, dtype)
                tl.store(tensor_ptr + offs, tl.load(sums + offs, mask=mask, cache_modifier=".cg"), mask=mask)
    tl.store(counters_ptr + pid, call)


def _cupy_runtime():
    try:
        from cupy.cuda import runtime
    except ImportError:
        return None
    return runtime


class CustomAllReduce:
    """One rank's buffers and flags; ``all_reduce`` runs the one-shot or two-shot kernel on the current stream.

    ``all_gather_bytes(record)`` returns every rank's ``record`` (bytes of equal length) in rank
    order; the group provides it. Construct it on every rank at once, after
    :meth:`is_possible` said yes on every rank.
    """

    def __init__(self, rank: int, world_size: int, device: torch.device,
                 all_gather_bytes: Callable[[bytes], list[bytes]], max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        runtime = _cupy_runtime()
        if runtime is None:
            raise RuntimeError("the custom all-reduce needs CuPy's CUDA runtime binding")
        self.rank, self.world_size, self.device, self.max_bytes = rank, world_size, device, max_bytes
        self._runtime = runtime
        self._opened: list[int] = []
        num_sms = torch.cuda.get_device_properties(device).multi_processor_count
        # Two halves of data, then one int32 flag per (program, source rank).
        self._half_bytes = max_bytes
        flag_bytes = _MAX_PROGRAMS_PER_SM * num_sms * world_size * 4
        with torch.cuda.device(device):
            self._own = runtime.malloc(2 * max_bytes + flag_bytes)
            runtime.memset(self._own, 0, 2 * max_bytes + flag_bytes)
            handle = runtime.ipcGetMemHandle(self._own)
        records = [_RECORD.unpack(r) for r in all_gather_bytes(
            _RECORD.pack(os.getpid(), device.index, num_sms, self._own, bytes(handle)))]
        # Same grid on every rank: the programs of one index meet at the barrier.
        min_sms = min(sms for _, _, sms, _, _ in records)
        self.max_programs = _PROGRAMS_PER_SM * min_sms
        bases = []
        with torch.cuda.device(device):
            for peer, (pid, peer_device, _, pointer, peer_handle) in enumerate(records):
                if peer == rank:
                    bases.append(self._own)
                elif pid == os.getpid():
                    self._enable_peer_access(peer_device)
                    bases.append(pointer)
                else:
                    opened = runtime.ipcOpenMemHandle(peer_handle, _CUDA_IPC_MEM_LAZY_ENABLE_PEER_ACCESS)
                    self._opened.append(opened)
                    bases.append(opened)
        self._buffer_ptrs = torch.tensor(bases, dtype=torch.int64, device=device)
        self._signal_ptrs = torch.tensor([b + 2 * max_bytes for b in bases], dtype=torch.int64, device=device)
        self._counters = torch.zeros(_MAX_PROGRAMS_PER_SM * min_sms, dtype=torch.int32, device=device)
        # Elements per program per iteration (per block, in the two-shot), warps per program, and the
        # smallest tensor of the two-shot in bytes: the same on every rank, as every rank must run the
        # same kernel on the same partition. No two-shot at two ranks by default: it reads as many
        # bytes there as the one-shot, and meets once more.
        self.block, self.num_warps = _BLOCK, _NUM_WARPS
        self.two_shot_min_bytes: float = TWO_SHOT_MIN_BYTES if world_size > 2 else math.inf
        # The all-reduce benchmark varies these and max_programs (up to _MAX_PROGRAMS_PER_SM per SM)
        # with every rank idle. A smaller grid leaves the other programs' counters behind (alike on
        # every rank), so their halves stop alternating in step with the others': harmless while
        # calls of one kernel follow (each program keeps to its own chunks), unsafe if one-shot and
        # two-shot calls then mix.

    @staticmethod
    def is_possible(devices: list[int]) -> bool:
        """Whether every pair of these GPUs can read each other's memory directly, there are at most
        MAX_WORLD_SIZE of them, and CuPy is there."""
        if _cupy_runtime() is None or len(devices) > MAX_WORLD_SIZE:
            return False
        return all(torch.cuda.can_device_access_peer(a, b) for a in devices for b in devices if a != b)

    def _enable_peer_access(self, peer_device: int) -> None:
        try:
            self._runtime.deviceEnablePeerAccess(peer_device)
        except self._runtime.CUDARuntimeError as exc:
            if exc.status != _CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED:
                raise

    def supports(self, tensor: torch.Tensor) -> bool:
        """Whether this tensor takes a custom kernel (a sum of a small contiguous float tensor)."""
        return (tensor.device == self.device and tensor.dtype in _SUPPORTED_DTYPES and tensor.is_contiguous()
                and 0 < tensor.nbytes <= self.max_bytes)

    def all_reduce(self, tensor: torch.Tensor) -> None:
        """Sums ``tensor`` over the ranks, in place, on the current stream (graph-capturable)."""
        kernel = (_two_shot_all_reduce_kernel if tensor.nbytes >= self.two_shot_min_bytes
                  else _one_shot_all_reduce_kernel)
        # Always the full grid (programs without chunks only take part in the barriers): see above.
        kernel[(self.max_programs,)](tensor, self._buffer_ptrs, self._signal_ptrs, self._counters, tensor.numel(),
                                     self._half_bytes // tensor.element_size(), RANK=self.rank,
                                     WORLD_SIZE=self.world_size, BLOCK=self.block, num_warps=self.num_warps)

    def close(self) -> None:
        """Frees this rank's buffer and closes the peers' (every rank at once, with the GPUs idle)."""
        if self._own is None:
            return
        with torch.cuda.device(self.device):
            torch.cuda.synchronize(self.device)
            for opened in self._opened:
                self._runtime.ipcCloseMemHandle(opened)
            self._runtime.free(self._own)
        self._opened, self._own = [], None
