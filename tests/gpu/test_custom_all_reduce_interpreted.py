"""The custom all-reduce kernels' protocol under Triton's interpreter (``TRITON_INTERPRET=1``).

Ranks are forked processes sharing buffers at the same addresses (shared memory mapped before the
fork), each running the kernels on CPU tensors; the interpreter runs one program at a time, so each
rank's program ``p`` meets the others' at the flag barriers. Repeated calls of changing sizes (tails
of partial chunks and super blocks, a single element, several chunks per program) and dtypes, of
the one-shot kernel, the two-shot kernel, or both in turn on the same buffers and counters, must
give every rank the float32 rank-order sum, rounded once. Random inputs make the order of the
additions show. Calls numbered across 2**30 (where the flags, twice the call numbers, wrap around
in int32) and across 2**31 (where the counters do) check the barriers and the double buffer there.
On a GPU the thread-rank tests in ``test_tensor_parallel_gpu.py`` cover the kernels instead.
"""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch

from tests.gpu.triton_env import INTERPRET

pytestmark = pytest.mark.skipif(not INTERPRET or not hasattr(os, "fork"),
                                reason="runs the kernels under TRITON_INTERPRET=1 with forked ranks")

PROGRAMS, BLOCK, HALF_BYTES = 4, 256, 32768
# Elements: tails of chunks and of super blocks of 3 and 4 blocks, one element, a whole float32 half
# (up to 3 super blocks per program), exact multiples of both super blocks (6144).
SIZES = (5000, 300, 4096, 1, 8192, 6144, 2500)
DTYPES = (torch.float32, torch.float16)  # by size, in turn: 8192 is float32
CALLS = 3  # per size
# Kernels taking turns call by call: three calls of two kernels cover both kernels on both halves
# and every switch between them.
SCHEDULES = {"one-shot": ("one_shot",), "two-shot": ("two_shot",), "mixed": ("one_shot", "two_shot", "two_shot")}
TIMEOUT_S = 300


def _int32(value: int) -> int:
    """``value`` wrapped around to int32, as the kernels' counters and flags hold it."""
    return (value + 2**31) % 2**32 - 2**31


def _input(rank: int, size_index: int, call: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed((rank * len(SIZES) + size_index) * CALLS + call)
    return torch.randn(SIZES[size_index], generator=gen).to(DTYPES[size_index % len(DTYPES)])


def _rank_order_sum(world: int, size_index: int, call: int) -> torch.Tensor:
    total = torch.zeros(SIZES[size_index])
    for rank in range(world):
        total += _input(rank, size_index, call).float()
    return total.to(DTYPES[size_index % len(DTYPES)])


def _wait_for_ranks(children: list[int]) -> None:
    """Waits for every forked rank; kills them all if any fails or they outlast TIMEOUT_S (a rank
    left waiting at a barrier spins for ever)."""
    deadline, pending, failed = time.monotonic() + TIMEOUT_S, set(children), []
    while pending and not failed and time.monotonic() < deadline:
        for pid in list(pending):
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                pending.discard(pid)
                if status != 0:
                    failed.append(children.index(pid))
        time.sleep(0.01)
    for pid in pending:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    assert not failed, f"rank(s) {failed} failed"
    assert not pending, f"ranks {sorted(children.index(p) for p in pending)} still running after {TIMEOUT_S} s"


@pytest.mark.parametrize("schedule, first_call", [
    *((schedule, 0) for schedule in SCHEDULES),
    # The wrap-arounds concern the counters and barriers, which both kernels share: mixed calls only.
    pytest.param("mixed", 2**30 - 7, id="mixed-flags-wrap"),
    pytest.param("mixed", 2**31 - 7, id="mixed-counters-wrap"),
])
@pytest.mark.parametrize("world", [3, 4])
def test_every_rank_gets_the_rank_order_sum_over_repeated_calls(world, schedule, first_call):
    from novainfer.distributed import custom_all_reduce

    kernels = [getattr(custom_all_reduce, f"_{name}_all_reduce_kernel") for name in SCHEDULES[schedule]]
    # Per rank: two halves of data, then an int32 flag per (program, source rank); counters and
    # flags as they are after first_call calls.
    flag_bytes = PROGRAMS * world * 4
    buffers = [torch.zeros(2 * HALF_BYTES + flag_bytes, dtype=torch.uint8).share_memory_() for _ in range(world)]
    flags = [b[2 * HALF_BYTES:].view(torch.int32).fill_(_int32(2 * first_call)) for b in buffers]
    counters = [torch.full((PROGRAMS,), _int32(first_call), dtype=torch.int32).share_memory_() for _ in range(world)]
    buffer_ptrs = torch.tensor([b.data_ptr() for b in buffers], dtype=torch.int64)
    signal_ptrs = torch.tensor([f.data_ptr() for f in flags], dtype=torch.int64)
    results = torch.zeros(world, len(SIZES), CALLS, max(SIZES)).share_memory_()
    children = []
    for rank in range(world):
        pid = os.fork()
        if pid == 0:  # a rank: run every call, store what it got, leave without pytest's teardown
            status = 1
            try:
                for i, size in enumerate(SIZES):
                    for call in range(CALLS):
                        tensor = _input(rank, i, call)
                        kernel = kernels[(i * CALLS + call) % len(kernels)]
                        kernel[(PROGRAMS,)](tensor, buffer_ptrs, signal_ptrs, counters[rank], size,
                                            HALF_BYTES // tensor.element_size(), RANK=rank, WORLD_SIZE=world,
                                            BLOCK=BLOCK)
                        results[rank, i, call, :size] = tensor.float()
                status = 0
            finally:
                os._exit(status)
        children.append(pid)
    _wait_for_ranks(children)
    for i, size in enumerate(SIZES):
        for call in range(CALLS):
            expected = _rank_order_sum(world, i, call).float()
            for rank in range(world):
                assert torch.equal(results[rank, i, call, :size], expected), (rank, size, call)
    calls = first_call + len(SIZES) * CALLS
    assert all(torch.equal(c, torch.full_like(c, _int32(calls))) for c in counters)
    # Every call's last barrier sets the flags to twice its number.
    assert all(torch.equal(f, torch.full_like(f, _int32(2 * calls))) for f in flags)
