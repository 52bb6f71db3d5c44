"""Triton kernel of the greedy verification of speculative drafts (CUDA).

:func:`novainfer.sample.rejection_sampler.greedy_verify_rows` in torch takes about fifteen small
launches (the drafts' rows cut to each request's count, the comparison with the target's argmax,
the accepted run's length, the emitted tokens, the packing for the host and each request's last
token); at batch 1 a speculative step's host time is most of its time, and each launch costs more
host time than device time. Here one program per request does all of it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from novainfer.layers.ops.launcher import KernelLauncher

# Positions are padded to at least this many, so that every k up to 7 shares one compiled variant
# (a step's k is the most drafts any of its requests has, which varies from step to step).
_MIN_POSITIONS = 8


@triton.jit(do_not_specialize=["num_positions", "stride_index", "stride_proposals", "stride_out"])
def _greedy_verify_kernel(argmax_ptr, index_ptr, stride_index, proposals_ptr, stride_proposals, proposal_rows_ptr,
                          num_drafts_ptr, out_ptr, stride_out, last_ptr, num_positions, POSITIONS: tl.constexpr):
    request = tl.program_id(0).to(tl.int64)
    position = tl.arange(0, POSITIONS)
    in_row = position < num_positions
    rows = tl.load(index_ptr + request * stride_index + position, mask=in_row, other=0)
    target = tl.load(argmax_ptr + rows, mask=in_row, other=-1)
    num_drafts = tl.load(num_drafts_ptr + request)
    drafted = position < num_drafts
    proposal_row = tl.load(proposal_rows_ptr + request)
    drafts = tl.load(proposals_ptr + proposal_row * stride_proposals + position, mask=drafted, other=-1)
    # The first position without a draft equal to the target's argmax there (at the latest the
    # one after the last draft): the drafts before it are accepted, and it emits the argmax.
    num_accepted = tl.min(tl.where(drafted & (drafts == target), POSITIONS, position), axis=0)
    out = out_ptr + request * stride_out
    tl.store(out, (num_accepted + 1).to(tl.int64))
    tl.store(out + 1 + position, tl.where(position <= num_accepted, target, -1), mask=in_row)
    tl.store(last_ptr + request, tl.sum(tl.where(position == num_accepted, target, 0), axis=0))


_launch_greedy_verify = KernelLauncher(_greedy_verify_kernel)


def greedy_verify_packed(argmax: torch.Tensor, index: torch.Tensor, proposals: torch.Tensor,
                         proposal_rows: torch.Tensor, num_drafts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`novainfer.sample.rejection_sampler.greedy_verify_rows` in one launch (same arguments,
    same outputs)."""
    batch, num_positions = index.shape
    packed = torch.empty(batch, 1 + num_positions, dtype=torch.int64, device=argmax.device)
    last = torch.empty(batch, dtype=torch.int64, device=argmax.device)
    if batch:
        _launch_greedy_verify[(batch,)](
            argmax, index, index.stride(0), proposals, proposals.stride(0), proposal_rows, num_drafts, packed,
            packed.stride(0), last, num_positions,
            POSITIONS=_compiled_positions(num_positions), num_warps=1)
    return packed, last


def _compiled_positions(num_positions: int) -> int:
    return max(_MIN_POSITIONS, triton.next_power_of_2(num_positions))


def warm_up(num_speculative_tokens: int, device: torch.device) -> None:
    """Compiles every variant that steps of up to ``num_speculative_tokens`` drafts per request launch."""
    ones = torch.ones(1, dtype=torch.int64, device=device)
    variants = {_compiled_positions(n): n for n in range(num_speculative_tokens + 1, 0, -1)}  # the fewest positions each
    for num_positions in variants.values():
        index = torch.zeros(1, num_positions, dtype=torch.int64, device=device)
        proposals = torch.zeros(1, max(num_positions - 1, 1), dtype=torch.int64, device=device)
        greedy_verify_packed(torch.zeros(1, dtype=torch.int64, device=device), index, proposals, ones - 1,
                             ones * min(num_positions - 1, 1))
