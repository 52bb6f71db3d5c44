"""Step input buffers: block tables travel packed at the step's width and land in full-width rows."""

import numpy as np
import pytest
import torch

from novainfer.worker.input_buffers import BufferCapacity, StepInputBuffers


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
