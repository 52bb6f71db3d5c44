"""The one-shot all-reduce kernel's protocol under Triton's interpreter (``TRITON_INTERPRET=1``).

Ranks are forked processes sharing buffers at the same addresses (shared memory mapped before the
fork), each running the kernel on CPU tensors; the interpreter runs one program at a time, so each
rank's program ``p`` meets the others' at the flag barrier. Checks that repeated calls of changing
sizes (the double-buffer parity and per-program counters) give every rank the rank-order sum. On a
GPU the two-thread tests in ``test_tensor_parallel_gpu.py`` cover the kernel instead.
"""

from __future__ import annotations

import os

import pytest
import torch

from tests.gpu.triton_env import INTERPRET

pytestmark = pytest.mark.skipif(not INTERPRET or not hasattr(os, "fork"),
                                reason="runs the kernel under TRITON_INTERPRET=1 with forked ranks")

WORLD, PROGRAMS, BLOCK, HALF = 3, 4, 1024, 8192
SIZES = (5000, 300, 4096, 1, 2500)
CALLS = 3


def _input(rank: int, size: int, call: int) -> torch.Tensor:
    return torch.arange(size, dtype=torch.float32) * (rank + 1) + call


def test_every_rank_gets_the_rank_order_sum_over_repeated_calls():
    from novainfer.distributed.custom_all_reduce import _one_shot_all_reduce_kernel

    # Per rank: two halves of data, then an int32 flag per (program, source rank).
    buffers = [torch.zeros(2 * HALF + PROGRAMS * WORLD, dtype=torch.float32).share_memory_() for _ in range(WORLD)]
    flags = [b[2 * HALF:].view(torch.int32) for b in buffers]
    buffer_ptrs = torch.tensor([b.data_ptr() for b in buffers], dtype=torch.int64)
    signal_ptrs = torch.tensor([f.data_ptr() for f in flags], dtype=torch.int64)
    results = torch.zeros(WORLD, len(SIZES), CALLS, max(SIZES)).share_memory_()
    children = []
    for rank in range(WORLD):
        pid = os.fork()
        if pid == 0:  # a rank: run every call, store what it got, leave without pytest's teardown
            status = 1
            try:
                counters = torch.zeros(PROGRAMS, dtype=torch.int32)
                for i, size in enumerate(SIZES):
                    for call in range(CALLS):
                        tensor = _input(rank, size, call)
                        _one_shot_all_reduce_kernel[(PROGRAMS,)](tensor, buffer_ptrs, signal_ptrs, counters, size,
                                                                 HALF, RANK=rank, WORLD_SIZE=WORLD, BLOCK=BLOCK)
                        results[rank, i, call, :size] = tensor
                status = 0
            finally:
                os._exit(status)
        children.append(pid)
    for pid in children:
        _, status = os.waitpid(pid, 0)
        assert status == 0, "a rank failed"
    for i, size in enumerate(SIZES):
        for call in range(CALLS):
            expected = sum(_input(rank, size, call) for rank in range(WORLD))
            for rank in range(WORLD):
                assert torch.equal(results[rank, i, call, :size], expected), (rank, size, call)
    assert all(torch.equal(f, torch.full_like(f, len(SIZES) * CALLS)) for f in flags)
