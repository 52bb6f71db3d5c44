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
@pytest.mark.parametrize("with_previous, with_shift", [(False, False), ("1-D", False), ("rows", "rows"),
                                                      (False, "rows"), ("rows", "own")])
def test_the_kernel_finishes_inputs_as_the_torch_operations(num_rows, width, num_tokens, num_logits,
                                                             with_previous, with_shift):
    """Previous tokens come 1-D (a step's sampled tokens) or as rows of a wider tensor holding -1
    entries (a speculative step's emitted tokens, a column of counts before them), as the model
    runner passes them; the views are taken on the device, so the kernel sees their strides."""
    expected = _filled(seed=num_tokens)
    generator = torch.Generator().manual_seed(1)
    packed = torch.randint(-1, 10**6, (40, 6), generator=generator)  # counts, then 5 tokens per row
    packed[:, 0] = torch.randint(1, 6, (40,), generator=generator)
    packed[::2, 3:] = -1  # rows with fewer tokens than columns
    rows = torch.randint(0, 40, (num_logits,), generator=generator)
    limits = torch.randint(0, 5, (num_logits,), generator=generator)
    actual = StepInputBuffers(CAPACITY, torch.device(DEVICE))
    actual._device_bytes.copy_(expected._host_bytes)
    results = {}
    for where, buffers in (("cpu", expected), (DEVICE, actual)):
        on = packed.to(where)
        previous = {False: None, "1-D": on[:, 1:].flatten(), "rows": on[:, 1:]}[with_previous]
        shift = {False: None, "rows": LogitsShift(on[:, 0], rows.to(where), limits.to(where)),
                 "own": LogitsShift(on[:num_logits, 0])}[with_shift]
        if buffers is expected:
            buffers.finish_inputs((num_rows, width), num_tokens, previous, shift, num_logits)
        else:
            finish_step_inputs(buffers.device_views, num_rows, width, num_tokens, previous, shift, num_logits)
        results[where if buffers is expected else "kernel"] = buffers._device_bytes.cpu()
    assert torch.equal(results["kernel"], results["cpu"])
    if with_previous and num_tokens > 1:  # the data cover inputs taken from -1 entries (taken as 0)
        assert (packed[:, 1:].flatten()[expected.device_views["token_sources"][:num_tokens].clamp(min=0)] < 0).any()


@pytest.mark.skipif(INTERPRET, reason="compiled variants exist on a GPU only")
def test_warm_up_compiles_every_variant_steps_launch():
    from novainfer.worker import input_ops

    def variants() -> set[str]:
        return {str(key) for cache in input_ops._finish_inputs_kernel.device_caches.values() for key in cache[0]}

    buffers = StepInputBuffers(CAPACITY, torch.device(DEVICE))
    warm_up(buffers.device_views)
    compiled = variants()
    test_the_kernel_finishes_inputs_as_the_torch_operations(5, 7, 25, 5, "rows", "rows")
    test_the_kernel_finishes_inputs_as_the_torch_operations(1, 1, 1, 1, "rows", "own")
    test_the_kernel_finishes_inputs_as_the_torch_operations(40, 70, 2500, 40, "1-D", False)
    assert variants() == compiled
