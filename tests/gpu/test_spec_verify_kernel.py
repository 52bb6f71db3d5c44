"""The Triton greedy verification (novainfer.sample.verify_ops) against the torch operations of
``greedy_verify_rows`` on the same inputs (which the CPU tests check against plain decoding). On a
GPU, or on CPU tensors under ``TRITON_INTERPRET=1``."""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("triton")

from novainfer.sample.rejection_sampler import greedy_verify_rows  # noqa: E402
from novainfer.sample.verify_ops import greedy_verify_packed  # noqa: E402
from tests.gpu.triton_env import DEVICE, INTERPRET, MARKS  # noqa: E402

pytestmark = MARKS


def _step(k: int, num_drafts: list[int], accepted: list[int], extra_columns: int, seed: int):
    """A verification step's inputs as the model runner builds them: request b verifies
    ``num_drafts[b]`` drafts (its rows: the last known token's, then one per draft), of which the
    first ``accepted[b]`` equal the target's argmax at their rows and the next (if any) differs.
    Its drafts sit in a shuffled row of proposals wider than k (a draft model's)."""
    rng = np.random.default_rng(seed)
    counts = np.asarray(num_drafts) + 1
    starts = np.cumsum(counts) - counts
    argmax = rng.integers(0, 1000, int(counts.sum()))
    index = starts[:, None] + np.minimum(np.arange(k + 1)[None, :], counts[:, None] - 1)
    proposal_rows = rng.permutation(len(counts))
    proposals = rng.integers(1000, 2000, (len(counts), k + extra_columns))  # never an argmax
    for b, (n, a) in enumerate(zip(num_drafts, accepted)):
        proposals[proposal_rows[b], :a] = argmax[starts[b]:starts[b] + a]
    return [torch.from_numpy(np.ascontiguousarray(x, dtype=np.int64)) for x in
            (argmax, index, proposals, proposal_rows, counts - 1)]


@pytest.mark.parametrize("k, num_drafts, accepted", [
    (4, [4, 4, 4, 2, 0, 3], [4, 0, 2, 2, 0, 1]),  # all, none, some, all of fewer, no drafts, one
    (1, [1, 0, 1], [1, 0, 0]),
    (9, [9, 5, 9], [9, 5, 3]),  # more positions than the smallest compiled width
])
@pytest.mark.parametrize("extra_columns", [0, 3])
def test_the_kernel_gives_the_torch_verification(k, num_drafts, accepted, extra_columns):
    inputs = _step(k, num_drafts, accepted, extra_columns, seed=k + extra_columns)
    want_packed, want_last = greedy_verify_rows(*inputs)  # CPU tensors: the torch operations
    assert want_packed[:, 0].tolist() == [a + 1 for a in accepted]  # the data cover the cases named
    packed, last = greedy_verify_packed(*(x.to(DEVICE) for x in inputs))
    assert torch.equal(packed.cpu(), want_packed) and torch.equal(last.cpu(), want_last)


@pytest.mark.skipif(INTERPRET, reason="compiled variants exist on a GPU only")
def test_warm_up_compiles_what_steps_of_fewer_drafts_launch():
    """Steps of any number of drafts up to the configured k launch no variant start-up did not compile."""
    from novainfer.sample import verify_ops

    def variants() -> set[str]:
        return {str(key) for cache in verify_ops._greedy_verify_kernel.device_caches.values() for key in cache[0]}

    verify_ops.warm_up(10, torch.device(DEVICE))
    compiled = variants()
    for k in range(11):
        greedy_verify_packed(*(x.to(DEVICE) for x in _step(k, [k], [k // 2], 0, seed=k)))
    assert variants() == compiled
