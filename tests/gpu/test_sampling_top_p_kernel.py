"""Top-p without a sort (novainfer.sample.ops.top_p_floors and draw_top_p) against the torch stages: a
stable descending sort of logits / temperature keeps the smallest prefix whose probability reaches
top_p (sampler.apply_top_k_top_p). On a GPU, or on CPU tensors under ``TRITON_INTERPRET=1``.

The kernel sums probabilities in another order than the sort's cumulative sum, so a token whose
preceding probability lies within rounding of top_p may fall on the other side (as its docstring
states): the comparison ignores tokens within 1e-5 of it. A row with a tie group across the
boundary checks that the kernel keeps the lowest ids of the group, as the stable sort does.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from novainfer.sample import SamplingMetadata  # noqa: E402
from novainfer.sample.ops import draw_top_p, top_p_floors  # noqa: E402
from novainfer.sample.rng import exponential_noise_torch  # noqa: E402
from novainfer.sample.sampler import (  # noqa: E402
    apply_penalties_and_min_tokens, apply_top_k_top_p, random_sample, sampling_probs)
from novainfer.sampling_params import SamplingParams  # noqa: E402
from tests.gpu.triton_env import DEVICE, DTYPES, INTERPRET, MARKS  # noqa: E402

pytestmark = MARKS

# Under the interpreter the search reads a row in several tiles too (its maximum found part way).
VOCAB, BLOCK, SEARCH_BLOCK = (700, 256, 128) if INTERPRET else (151_936, 4096, 1024)

PARAMS = [
    SamplingParams(temperature=0.0),  # greedy: every token
    SamplingParams(temperature=0.8, top_p=0.95),
    SamplingParams(temperature=1.3, top_p=0.5, seed=3),
    SamplingParams(temperature=0.6, top_p=0.999),
    SamplingParams(temperature=1.0),  # top_p 1: every token
    SamplingParams(temperature=1.0, top_p=0.7, seed=4),  # the boundary inside a tie group
    SamplingParams(temperature=0.5, top_p=0.1),  # the top token only
    SamplingParams(temperature=2.0, top_p=0.9, repetition_penalty=1.3),
]


def batch(dtype: torch.dtype, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(len(PARAMS), VOCAB, generator=generator) * 3
    # Row 5: one token of weight 4, then 60 tied tokens of weight 1 spread over the chunks, the
    # rest negligible: the tied token r (by id) is kept while (4 + r) / 64 < 0.7, so 41 of them.
    logits[5] = -30.0
    logits[5, 11] = torch.tensor(4.0).log()
    logits[5, torch.arange(60) * (VOCAB // 60) + 3] = 0.0
    logits[1, :VOCAB // 2] = float("-inf")  # banned tokens
    return logits.to(dtype)


def reference_kept(logits: torch.Tensor, metadata: SamplingMetadata) -> tuple[torch.Tensor, torch.Tensor]:
    """The tokens the sort keeps, and those whose preceding probability is within 1e-5 of top_p."""
    tempered = logits.float() / metadata.temperature.cpu().unsqueeze(1)
    top_p = metadata.top_p.cpu()
    kept = apply_top_k_top_p(tempered, None, top_p) > float("-inf")
    every = metadata.is_greedy.cpu() | (top_p >= 1.0)
    sorted_logits, sorted_ids = tempered.sort(dim=-1, descending=True, stable=True)
    probs = sorted_logits.double().softmax(dim=-1)
    near_sorted = ((probs.cumsum(dim=-1) - probs) - top_p.double().unsqueeze(1)).abs() < 1e-5
    near = torch.zeros_like(kept).scatter(1, sorted_ids, near_sorted) & ~every.unsqueeze(1)
    return torch.where(every.unsqueeze(1), logits.float() > float("-inf"), kept), near


def kernel_kept(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    greedy = metadata.is_greedy.contiguous().view(torch.uint8)
    floor, tie_keep, tie_offset = top_p_floors(logits.to(DEVICE), metadata.temperature, metadata.top_p, greedy,
                                              draw_block=BLOCK, block=SEARCH_BLOCK)
    floor, tie_keep, tie_offset = floor.cpu(), tie_keep.cpu(), tie_offset.cpu()
    bits = logits.float().view(torch.int32)
    keys = bits ^ ((bits >> 31) & 0x7FFFFFFF)
    ties = keys == floor.unsqueeze(1)
    chunk = torch.arange(VOCAB) // BLOCK
    # Rank among the tokens at the floor: the chunk's offset plus those before it in the chunk.
    starts = torch.cat([torch.zeros(len(PARAMS), 1, dtype=torch.long), ties.long().cumsum(1)], dim=1)
    within = ties.long().cumsum(1) - 1 - starts.gather(1, (chunk * BLOCK).expand(len(PARAMS), -1))
    rank = tie_offset.long().gather(1, chunk.expand(len(PARAMS), -1)) + within
    kept = (keys > floor.unsqueeze(1)) | (ties & (rank < tie_keep.unsqueeze(1)))
    return kept & (logits.float() > float("-inf"))


@pytest.mark.parametrize("dtype", list(dict.fromkeys([torch.float32, *DTYPES])))
def test_floors_keep_the_sorted_prefix(dtype):
    for seed in range(2):
        logits = batch(dtype, seed)
        metadata = SamplingMetadata.from_requests(PARAMS, [[]] * len(PARAMS), [[]] * len(PARAMS), DEVICE, VOCAB)
        kept = kernel_kept(logits, metadata)
        expected, near = reference_kept(logits, metadata)
        assert torch.equal(kept & ~near, expected & ~near)
        assert kept[5].sum().item() == 1 + 41 and kept[6].sum().item() == 1


@pytest.mark.parametrize("seed", range(3))
def test_top_p_draw_equals_the_torch_path_for_the_same_noise(seed):
    """Oracle: the torch stages (penalties, temperature, sorted top-p mask, exponential race with the
    same noise; greedy rows the argmax)."""
    logits = batch(torch.float32, seed).to(DEVICE)
    generator = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, VOCAB, (30,), generator=generator).tolist() for _ in PARAMS]
    metadata = SamplingMetadata.from_requests(PARAMS, [[]] * len(PARAMS), prompts, DEVICE, VOCAB)
    keys = torch.randint(0, 2**32, (len(PARAMS),), generator=generator).to(DEVICE)
    keys = torch.where(metadata.is_seeded, metadata.noise_keys, keys)
    penalized = apply_penalties_and_min_tokens(logits, metadata)
    tokens = draw_top_p(penalized, metadata, keys, block=BLOCK)
    noise = exponential_noise_torch(keys, torch.arange(VOCAB, device=keys.device))
    drawn = random_sample(sampling_probs(penalized.float(), metadata), noise)
    expected = torch.where(metadata.is_greedy, penalized.float().argmax(dim=-1), drawn)
    assert tokens.tolist() == expected.tolist()
