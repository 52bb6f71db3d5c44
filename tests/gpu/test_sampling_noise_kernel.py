"""The Triton kernel of the seeded sampler's counter-based noise against its torch version (the
same hash, so the same bits; ``log`` within a few float32 ulps). On a GPU, or on CPU tensors under
``TRITON_INTERPRET=1``."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from novainfer.sample.ops import exponential_noise_triton  # noqa: E402
from novainfer.sample.rng import exponential_noise_torch, row_keys, seed_lanes  # noqa: E402
from tests.gpu.triton_env import DEVICE, INTERPRET, MARKS  # noqa: E402

pytestmark = MARKS


@pytest.mark.parametrize("per_row_ids", [False, True], ids=["whole_vocabulary", "candidates"])
def test_kernel_matches_torch(per_row_ids):
    vocab, rows = (3000, 5) if INTERPRET else (151_936, 64)
    lanes = torch.tensor([seed_lanes(s) for s in (0, 1, -1, 2**63 + 5, 123456789)] * (rows // 5 + 1))[:rows]
    keys = row_keys(lanes[:, 0], lanes[:, 1], torch.arange(rows) * 7).to(DEVICE)
    generator = torch.Generator().manual_seed(0)
    token_ids = (torch.randint(0, vocab, (rows, 50), generator=generator) if per_row_ids
                 else torch.arange(vocab)).to(DEVICE)
    got = exponential_noise_triton(keys, token_ids)
    expected = exponential_noise_torch(keys, token_ids)
    assert got.shape == expected.shape == (rows, token_ids.shape[-1]) and got.dtype == torch.float32
    torch.testing.assert_close(got, expected, rtol=4e-7, atol=0)
    assert bool((got > 0).all()) and bool(got.isfinite().all())
