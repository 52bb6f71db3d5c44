"""The Triton kernel that finishes a step's inputs (novainfer.worker.input_ops) against
``StepInputBuffers.finish_inputs``' torch operations on CPU buffers holding the same bytes (which
tests/test_input_buffers.py checks against plain loops). On a GPU, or on CPU tensors under
``TRITON_INTERPRET=1``."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from novainfer.worker.input_buffers import BufferCapacity, LogitsShift, StepInputBuffers  # noqa: E402
from novainfer.worker.input_ops import finish_step_inputs, warm_up  # noqa: E402
from tests.gpu.triton_env import DEVICE, INTERPRET, MARKS  # noqa: E402

pytestmark = MARKS
CAPACITY = BufferCapacity(max_tokens=3000, max_seqs=40, max_blocks_per_seq=70)


def _filled(seed: int) -> StepInputBuffers:
    """CPU buffers of random bytes, with token sources and logits rows in range."""
    buffers = StepInputBuffers(CAPACITY, torch.device("cpu"))
    generator = torch.Generator().manual_seed(seed)
    buffers._host_bytes.copy_(torch.randint(0, 256, buffers._host_bytes.shape, dtype=torch.uint8,
                                            generator=generator))
    views = buffers.device_views
    views["token_sources"].copy_(torch.randint(-1, 50, views["token_sources"].shape, generator=generator))
    views["logits_indices"].copy_(torch.randint(0, 1000, views["logits_indices"].shape, generator=generator))
    return buffers


@pytest.mark.parametrize("num_rows, width, num_tokens, num_logits", [
    (1, 1, 1, 1), (5, 7, 25, 5), (40, 70, 2500, 40), (0, 0, 3000, 0),  # the last: tokens only, past one block
])
@pytest.mark.parametrize("with_previous, with_shift", [(False, False), (True, False), (True, True), (False, True)])
def test_the_kernel_finishes_inputs_as_the_torch_operations(num_rows, width, num_tokens, num_logits,
                                                             with_previous, with_shift):
    expected = _filled(seed=num_tokens)
    generator = torch.Generator().manual_seed(1)
    previous = torch.randint(0, 10**6, (50,), generator=generator) if with_previous else None
    # The counts as a speculative step keeps them: a column of its packed results.
    shift = LogitsShift(torch.randint(1, 6, (8, 6), generator=generator)[:, 0],
                        torch.randint(0, 8, (num_logits,), generator=generator),
                        torch.randint(0, 5, (num_logits,), generator=generator)) if with_shift else None
    actual = StepInputBuffers(CAPACITY, torch.device(DEVICE))
    actual._device_bytes.copy_(expected._host_bytes)
    expected.finish_inputs((num_rows, width), num_tokens, previous, shift, num_logits)
    finish_step_inputs(actual.device_views, num_rows, width, num_tokens,
                       None if previous is None else previous.to(DEVICE),
                       None if shift is None else LogitsShift(*(t.to(DEVICE) for t in vars(shift).values())),
                       num_logits)
    assert torch.equal(actual._device_bytes.cpu(), expected._host_bytes)


@pytest.mark.skipif(INTERPRET, reason="compiled variants exist on a GPU only")
def test_warm_up_compiles_every_variant_steps_launch():
    from novainfer.worker import input_ops

    def variants() -> set[str]:
        return {str(key) for cache in input_ops._finish_inputs_kernel.device_caches.values() for key in cache[0]}

    buffers = StepInputBuffers(CAPACITY, torch.device(DEVICE))
    warm_up(buffers.device_views)
    compiled = variants()
    test_the_kernel_finishes_inputs_as_the_torch_operations(5, 7, 25, 5, True, True)
    test_the_kernel_finishes_inputs_as_the_torch_operations(40, 70, 2500, 40, False, False)
    assert variants() == compiled
