"""A one-shot all-reduce for small tensors between GPUs that can read each other's memory (NVLink).

A decode step all-reduces a few megabytes twice per decoder layer. NCCL's ring algorithms take
tens of microseconds for that; here every rank copies its tensor into a buffer every peer can
read, the ranks meet at a flag barrier, and each rank sums all the buffers itself in rank order
(so every rank gets the same bits) - one kernel, one round of reads over NVLink. Larger tensors
(prefill steps) stay with NCCL, whose ring moves fewer bytes per rank.

The kernel keeps no host state between calls, so CUDA graphs can capture it: each program keeps
its own call counter in device memory, and a call's flags carry that counter. The grid is the same
for every call, so program ``p`` always handles the same chunks and every program's counter stays
equal to the number of calls. Buffers alternate between two halves by call parity: a rank one call
ahead never overwrites data a slower peer is still reading, and it cannot get two calls ahead,
because each call's barrier waits for the same program of every peer.

Ranks share their buffers by pointer when they are threads of one process (``uni``; peer access is
enabled) and by CUDA IPC handle when they are processes (``mp``). CuPy provides both runtime calls.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Callable

import torch
import triton
import triton.language as tl

# Above this many bytes NCCL's ring is as fast or faster (one-shot reads world_size x the bytes).
DEFAULT_MAX_BYTES = 4 * 1024 * 1024
_BLOCK = 2048
_NUM_WARPS = 8
# Programs per multiprocessor; all of them must be resident at once (they wait for each other's peers).
_PROGRAMS_PER_SM = 1
_MAX_PROGRAMS_PER_SM = 4
_SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_CUDA_IPC_MEM_LAZY_ENABLE_PEER_ACCESS = 1
_CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED = 704
# What each rank publishes: pid, device index, SM count, buffer pointer, IPC handle (64 bytes).
_RECORD = struct.Struct("<qqqq64s")


@triton.jit
def _one_shot_all_reduce_kernel(tensor_ptr, buffer_ptrs, signal_ptrs, counters_ptr, n_elements, half_elements,
                                RANK: tl.constexpr, WORLD_SIZE: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    stride = tl.num_programs(0) * BLOCK
    dtype = tensor_ptr.dtype.element_ty
    epoch = tl.load(counters_ptr + pid) + 1
    half = (epoch % 2).to(tl.int64) * half_elements
    # Buffers are 16-byte aligned; saying so lets the copies below use 16-byte vector accesses.
    own = tl.multiple_of(tl.load(buffer_ptrs + RANK).to(tl.pointer_type(dtype)), 16) + half
    # 1. This program's chunks of the input into this rank's buffer.
    for start in range(pid * BLOCK, n_elements, stride):
        offs = start + tl.arange(0, BLOCK)
        mask = offs < n_elements
        tl.store(own + offs, tl.load(tensor_ptr + offs, mask=mask), mask=mask)
    # 2. Barrier with the same program of every rank: release our chunks, acquire theirs.
    tl.debug_barrier()
    for peer in tl.static_range(WORLD_SIZE):
        flags = tl.load(signal_ptrs + peer).to(tl.pointer_type(tl.int32))
        tl.atomic_xchg(flags + pid * WORLD_SIZE + RANK, epoch, sem="release", scope="sys")
    own_flags = tl.load(signal_ptrs + RANK).to(tl.pointer_type(tl.int32)) + pid * WORLD_SIZE
    for peer in tl.static_range(WORLD_SIZE):
        while tl.atomic_add(own_flags + peer, 0, sem="acquire", scope="sys") < epoch:
            pass
    tl.debug_barrier()
    # 3. Sum every rank's chunks in rank order, in float32, into the tensor.
    for start in range(pid * BLOCK, n_elements, stride):
        offs = start + tl.arange(0, BLOCK)
        mask = offs < n_elements
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for peer in tl.static_range(WORLD_SIZE):
            src = tl.multiple_of(tl.load(buffer_ptrs + peer).to(tl.pointer_type(dtype)), 16) + half
            acc += tl.load(src + offs, mask=mask, cache_modifier=".cg").to(tl.float32)
        tl.store(tensor_ptr + offs, acc.to(dtype), mask=mask)
    tl.store(counters_ptr + pid, epoch)


def _cupy_runtime():
    try:
        from cupy.cuda import runtime
    except ImportError:
        return None
    return runtime


class CustomAllReduce:
    """One rank's buffers and flags; ``all_reduce`` runs the one-shot kernel on the current stream.

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
        # Elements per program per iteration, and warps per program (the same on every rank). The
        # all-reduce benchmark varies these and max_programs (up to _MAX_PROGRAMS_PER_SM per SM).
        self.block, self.num_warps = _BLOCK, _NUM_WARPS

    @staticmethod
    def is_possible(devices: list[int]) -> bool:
        """Whether every pair of these GPUs can read each other's memory directly, and CuPy is there."""
        if _cupy_runtime() is None:
            return False
        return all(torch.cuda.can_device_access_peer(a, b) for a in devices for b in devices if a != b)

    def _enable_peer_access(self, peer_device: int) -> None:
        try:
            self._runtime.deviceEnablePeerAccess(peer_device)
        except self._runtime.CUDARuntimeError as exc:
            if exc.status != _CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED:
                raise

    def supports(self, tensor: torch.Tensor) -> bool:
        """Whether this tensor takes the one-shot path (a sum of a small contiguous float tensor)."""
        return (tensor.device == self.device and tensor.dtype in _SUPPORTED_DTYPES and tensor.is_contiguous()
                and 0 < tensor.nbytes <= self.max_bytes)

    def all_reduce(self, tensor: torch.Tensor) -> None:
        """Sums ``tensor`` over the ranks, in place, on the current stream (graph-capturable)."""
        n = tensor.numel()
        # Always the full grid (programs without chunks only take part in the barrier): see above.
        _one_shot_all_reduce_kernel[(self.max_programs,)](tensor, self._buffer_ptrs, self._signal_ptrs,
                                                           self._counters, n,
                                                           self._half_bytes // tensor.element_size(),
                                                           RANK=self.rank, WORLD_SIZE=self.world_size,
                                                           BLOCK=self.block, num_warps=self.num_warps)

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
