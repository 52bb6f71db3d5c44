"""Triton kernel that finishes a step's inputs on the device after their copy (CUDA).

Once the host buffer's bytes are on the device, three things may remain before the forward: the
packed block tables are spread into their rows, the input tokens that the host has not seen are
taken from the previous step's tokens, and a draft's catch-up moves its logits rows by how many
tokens each request got. In torch that is up to eleven launches and views
(:meth:`novainfer.worker.input_buffers.StepInputBuffers.finish_inputs` on other devices, the
reference this kernel is tested against); each costs more host time than the device spends on it,
three times per step of a draft model's speculative decoding. Here it is one launch: axis 1 of
the grid picks the part, axis 0 the block of entries.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from novainfer.layers.ops.common import cdiv
from novainfer.layers.ops.launcher import KernelLauncher
from novainfer.worker.input_buffers import LogitsShift

_BLOCK = 1024


@triton.jit(do_not_specialize=["table_stride", "num_table_entries", "width", "previous_width", "previous_row_stride",
                               "previous_stride", "num_tokens", "counts_stride", "num_logits"],
            do_not_specialize_on_alignment=["previous_ptr", "counts_ptr", "rows_ptr", "limits_ptr"])
def _finish_inputs_kernel(packed_ptr, tables_ptr, table_stride, num_table_entries, width,
                          input_ids_ptr, sources_ptr, previous_ptr, previous_width, previous_row_stride,
                          previous_stride, num_tokens,
                          logits_ptr, counts_ptr, counts_stride, rows_ptr, limits_ptr, num_logits,
                          HAS_PREVIOUS: tl.constexpr, HAS_SHIFT: tl.constexpr, SHIFT_ROWS: tl.constexpr,
                          BLOCK: tl.constexpr):
    part = tl.program_id(1)
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    if part == 0:  # the packed [rows, width] block tables into the first rows of the full table
        mask = offsets < num_table_entries
        values = tl.load(packed_ptr + offsets, mask=mask)
        tl.store(tables_ptr + (offsets // width) * table_stride + offsets % width, values, mask=mask)
    elif part == 1:
        if HAS_PREVIOUS:  # input token i is entry sources[i] of the flattened previous, where that is >= 0
            sources = tl.load(sources_ptr + offsets, mask=offsets < num_tokens, other=-1)
            taken = sources >= 0
            where = (sources // previous_width) * previous_row_stride + (sources % previous_width) * previous_stride
            tokens = tl.load(previous_ptr + where, mask=taken)
            tl.store(input_ids_ptr + offsets, tl.maximum(tokens, 0), mask=taken)
    else:
        if HAS_SHIFT:  # logits row j moves by min(counts[rows[j]] - 1, limits[j]), or counts[j] - 1
            mask = offsets < num_logits
            if SHIFT_ROWS:
                rows = tl.load(rows_ptr + offsets, mask=mask, other=0)
                counts = tl.load(counts_ptr + rows * counts_stride, mask=mask, other=1)
                moves = tl.minimum(counts - 1, tl.load(limits_ptr + offsets, mask=mask, other=0))
            else:
                moves = tl.load(counts_ptr + offsets * counts_stride, mask=mask, other=1) - 1
            indices = tl.load(logits_ptr + offsets, mask=mask)
            tl.store(logits_ptr + offsets, indices + moves, mask=mask)


_launch_finish_inputs = KernelLauncher(_finish_inputs_kernel)


def finish_step_inputs(views: dict[str, torch.Tensor], num_table_rows: int, width: int, num_tokens: int,
                       previous: torch.Tensor | None, shift: LogitsShift | None, num_logits: int) -> None:
    """:meth:`StepInputBuffers.finish_inputs` on CUDA, in one launch (same arguments; ``views`` are
    the buffers' device views)."""
    num_entries = num_table_rows * width
    most = max(num_entries, num_tokens if previous is not None else 0, num_logits if shift is not None else 0)
    if most:
        _launch(views, cdiv(most, _BLOCK), num_entries, max(width, 1), num_tokens, previous, shift, num_logits)


def warm_up(views: dict[str, torch.Tensor]) -> None:
    """Compiles the kernel's variants (with and without previous tokens, with a shift with or
    without rows, or none) on ``views``, writing nothing (every part is empty)."""
    none = torch.zeros(1, dtype=torch.int64, device=views["input_ids"].device)
    for previous in (None, none):
        for shift in (None, LogitsShift(none), LogitsShift(none, none, none)):
            _launch(views, 1, 0, 1, 0, previous, shift, 0)


def _launch(views: dict[str, torch.Tensor], num_blocks: int, num_entries: int, width: int, num_tokens: int,
            previous: torch.Tensor | None, shift: LogitsShift | None, num_logits: int) -> None:
    tables, input_ids, logits = views["block_tables"], views["input_ids"], views["logits_indices"]
    # An absent part's pointers are never read: any tensor of the step stands in for them.
    previous_arg = previous if previous is not None else input_ids
    # Entry e of the flattened tokens: row e // width, column e % width (a 1-D tensor is one row).
    if previous_arg.dim() == 2:
        previous_layout = (max(previous_arg.shape[1], 1), previous_arg.stride(0), previous_arg.stride(1))
    else:
        previous_layout = (max(previous_arg.shape[0], 1), 0, previous_arg.stride(0))
    counts = shift.counts if shift is not None else logits
    rows, limits = (shift.rows, shift.limits) if shift is not None and shift.rows is not None else (logits, logits)
    num_parts = 3 if shift is not None else 2 if previous is not None else 1
    _launch_finish_inputs[(num_blocks, num_parts)](
        views["packed_block_tables"], tables, tables.stride(0), num_entries, width,
        input_ids, views["token_sources"], previous_arg, *previous_layout, num_tokens,
        logits, counts, counts.stride(0), rows, limits, num_logits,
        HAS_PREVIOUS=previous is not None, HAS_SHIFT=shift is not None,
        SHIFT_ROWS=shift is not None and shift.rows is not None, BLOCK=_BLOCK, num_warps=4)
