"""Step input buffers: block tables travel packed at the step's width and land in full-width rows."""

import numpy as np
import pytest
import torch

from novainfer.worker.input_buffers import BufferCapacity, LogitsShift, StepInputBuffers


def _buffers() -> StepInputBuffers:
    return StepInputBuffers(BufferCapacity(max_tokens=32, max_seqs=8, max_blocks_per_seq=64), torch.device("cpu"))


def test_packed_block_tables_land_in_their_rows_and_leave_other_columns() -> None:
    buffers = _buffers()
    rng = np.random.default_rng(0)
    wide = rng.integers(0, 1000, size=(8, 64), dtype=np.int32)
    buffers.stage_block_tables(wide)
    buffers.unpack_block_tables(*wide.shape)
    step = rng.integers(0, 1000, size=(5, 7), dtype=np.int32)
    end = buffers.stage_block_tables(step)
    buffers.unpack_block_tables(*step.shape)
    table = buffers.device_views["block_tables"].numpy()
    expected = wide.copy()
    expected[:5, :7] = step
    np.testing.assert_array_equal(table, expected)
    # The step's data ends right after its packed tables: the copy carries 5 x 7 entries, not 5 rows of 64.
    assert end == buffers.offsets["packed_block_tables"] + step.size * 4


def test_copy_between_buffers_carries_the_packed_tables() -> None:
    source, target = _buffers(), _buffers()
    step = np.arange(12, dtype=np.int32).reshape(3, 4)
    end = source.stage_block_tables(step)
    source.host["seq_lens"][:3] = [1, 2, 3]
    target.copy_to_device(end, source)
    target.unpack_block_tables(*step.shape)
    np.testing.assert_array_equal(target.device_views["block_tables"][:3, :4].numpy(), step)
    np.testing.assert_array_equal(target.device_views["seq_lens"][:3].numpy(), [1, 2, 3])


def test_copy_between_different_layouts_is_refused() -> None:
    other = StepInputBuffers(BufferCapacity(max_tokens=16, max_seqs=8, max_blocks_per_seq=64), torch.device("cpu"))
    with pytest.raises(ValueError, match="different layouts"):
        _buffers().copy_to_device(64, other)


def test_finish_inputs_takes_previous_tokens_and_shifts_logits_rows() -> None:
    """The reference (non-CUDA) finishing of a step's inputs against plain loops: inputs whose
    source is >= 0 become that entry of the previous tokens, the others keep their staged value,
    and logits row j moves by min(counts[rows[j]] - 1, limits[j])."""
    buffers = _buffers()
    rng = np.random.default_rng(1)
    staged = rng.integers(0, 1000, size=20)
    sources = rng.integers(-1, 6, size=20)
    previous = rng.integers(5000, 6000, size=6)
    logits = np.array([3, 7, 11, 19])
    counts, rows, limits = np.array([1, 5, 3]), np.array([2, 0, 1, 1]), np.array([4, 4, 4, 2])
    buffers.host["input_ids"][:20] = staged
    buffers.host["token_sources"][:20] = sources
    buffers.host["logits_indices"][:4] = logits
    shift = LogitsShift(*(torch.from_numpy(a) for a in (counts, rows, limits)))
    buffers.finish_inputs((0, 0), 20, torch.from_numpy(previous), shift, 4)
    want_ids = [previous[s] if s >= 0 else t for s, t in zip(sources, staged)]
    want_logits = [i + min(counts[r] - 1, limit) for i, r, limit in zip(logits, rows, limits)]
    np.testing.assert_array_equal(buffers.device_views["input_ids"][:20].numpy(), want_ids)
    np.testing.assert_array_equal(buffers.device_views["logits_indices"][:4].numpy(), want_logits)
    assert (sources >= 0).any() and (sources < 0).any()  # both kinds of input are covered
    # Without rows and limits, row j moves by its own count less one.
    buffers.host["logits_indices"][:3] = logits[:3]
    buffers.finish_inputs((0, 0), 0, None, LogitsShift(torch.from_numpy(counts)), 3)
    np.testing.assert_array_equal(buffers.device_views["logits_indices"][:3].numpy(), logits[:3] + counts - 1)


def test_copy_parts_cover_the_step_and_follow_the_source() -> None:
    """The slices a CUDA copy moves (kept between steps): from the start of the copied part to the
    step's end rounded up to a granule, never past the buffer, from the named source's host side."""
    from novainfer.worker import input_buffers

    capacity = BufferCapacity(max_tokens=1024, max_seqs=8, max_blocks_per_seq=64)
    own, driver = (StepInputBuffers(capacity, torch.device("cpu")) for _ in range(2))
    granule = input_buffers._COPY_GRANULE
    assert own.nbytes > own.copy_start + 2 * granule
    for source in (own, driver, own):
        for num_bytes in (own.copy_start + 1, own.copy_start + granule + 5, own.nbytes):
            device_part, host_part = own._copy_parts(source, num_bytes)
            end = min(-(-num_bytes // granule) * granule, own.nbytes)
            assert device_part.data_ptr() == own._device_bytes.data_ptr() + own.copy_start
            assert host_part.data_ptr() == source._host_bytes.data_ptr() + own.copy_start
            assert device_part.numel() == host_part.numel() == end - own.copy_start >= num_bytes - own.copy_start
            assert own._copy_parts(source, num_bytes)[0] is device_part  # kept
    assert len(own._copy_slices) <= 3 and own._copy_source is own  # a new source dropped the old slices
